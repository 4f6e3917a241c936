// Device side of cuda/p2p_all_reduce.h: the one-shot all-reduce kernel's parameters and launcher.
#pragma once
#include <cstddef>
#include <cstdint>

struct CUstream_st;

namespace fasttree {

inline constexpr int kP2pMaxRanks = 8;
inline constexpr int kP2pThreads = 512;
inline constexpr int kP2pMaxBlocks = 128;     // one wave (<= one block per SM): every block resident
inline constexpr int kP2pMaxVecPerThread = 8; // float4 per thread held between the two barriers
inline constexpr uint64_t kP2pHostPollAfterNs = 1000000;  // waits read the host abort flag after 1 ms
inline constexpr size_t kP2pMaxCount = size_t{kP2pMaxBlocks} * kP2pThreads * kP2pMaxVecPerThread * 4;

struct P2pAllReduceParams {
  float* data;                           // [count] this rank's buffer (== bufs[rank])
  const float* bufs[kP2pMaxRanks];       // every rank's buffer, rank order
  uint32_t* flags[kP2pMaxRanks];         // every rank's flags [2][kP2pMaxBlocks][kP2pMaxRanks]
  uint32_t* epoch;                       // [kP2pMaxBlocks] this rank's per-block call counter
  const volatile int* abort_flag;        // mapped host memory shared by the group (non-zero: give up)
  volatile int* error_flag;              // mapped host memory of this rank (set when a block gave up)
  int64_t count4;                        // float4 elements
  int rank, nranks;
  int vec_per_thread;                    // float4 per thread (<= kP2pMaxVecPerThread)
  uint64_t timeout_ns;
};

// Blocks = ceil(count4 / (kP2pThreads * vec_per_thread)) <= kP2pMaxBlocks (the caller sizes it).
void launch_p2p_all_reduce(const P2pAllReduceParams& p, int blocks, CUstream_st* stream);

}  // namespace fasttree
