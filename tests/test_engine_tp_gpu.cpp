// Tensor parallelism on GPUs (engine/tp_gpu_model.h, cuda/nccl_comm.h). Tests named TpGpu* skip
// with fewer than 2 CUDA devices; TpGpuHost* run everywhere (clear errors, the CPU path of --tp).
//
// Tolerance, tp 2 vs the single-GPU GpuModel on the same (bf16) weights: the ranks compute the same
// math with the reduction order of o_proj / down_proj changed (two fp32 partial GEMMs summed by
// NCCL instead of one K-loop) and bf16 roundings of the GEMM inputs that may flip, so every logit
// row must satisfy max |tp2 - tp1| <= kTpRelTol * max(1, max |tp1 logit|), kTpRelTol = 0.02 (the
// worst ratio seen is printed). Greedy tokens must be equal wherever tp 1's own top-1/top-2 gap is
// above 2 * kTpRelTol * max(1, |logit|) (below that a bf16 tie may legitimately flip the choice).
//
//   TpGpu.NcclAllReduce*       fp32 and bf16 sums over 2 GPUs; a peer that skips a collective
//                              makes wait() throw after its timeout (never a hang)
//   TpGpu.*Symmetric* / P2p*   in-place sums on NCCL symmetric windows and the P2P one-shot kernel
//                              (a missing peer: timeout error, abort ends a waiting kernel); models
//                              on windows / P2P give the logits of plain NCCL, bit for bit
//   TpGpu.MatchesTp1*          prefill (chunked, all logits, cached context) and tree decode
//                              batches, host weights (tiny / biased / replicated-kv configs), device
//                              random weights (sharded init == tp 1's weights), golden checkpoints
//   TpGpu.Scheduler*           the Scheduler on TpGpuModel: FastTree == per-request tokens, == tp 1
//   TpGpu.Llama7bWorkloads*    workloads A-D (small scale) on llama2-7b's shape, 8 greedy tokens:
//                              tp 2 == tp 1 except at bf16 ties (tp 1's logit gap <= kTpRelTol x top)
//   TpGpu.Failing* / BadInput  a rank that throws or stalls ends the call on every rank with one
//                              Error naming it; bad input is rejected and the model keeps working
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "cli_path.h"
#include "golden_util.h"
#include "model_test_util.h"
#include "core/half.h"
#include "cuda/backend.h"
#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "cuda/p2p_all_reduce.h"
#include "engine/cpu_model.h"
#include "engine/gpu_model.h"
#include "engine/gpu_weights.h"
#include "engine/model_config.h"
#include "engine/model_factory.h"
#include "engine/safetensors.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/slot_paths.h"
#include "engine/tp_gpu_model.h"
#include "engine/tp_shard.h"
#include "engine/weights.h"
#include "engine/workloads.h"
#include "engine_test_util.h"

namespace fasttree {
namespace {

using test::expect_error;
using test::concat;
using test::iota;
using test::llama_bias64;
using test::qwen64;
using test::random_tokens;
using test::row_scale;
using test::top2_gap;
using test::run_scheduler;
using test::Vec;
using Clock = std::chrono::steady_clock;

constexpr double kTpRelTol = 0.02;

#define SKIP_WITHOUT_TWO_GPUS() \
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs 2 CUDA devices, " << cuda_device_count() << " visible"



#if FASTTREE_HAVE_CUDA  // the device tests use cuda/device.h (built with the CUDA backend only)

double g_worst = 0.0;



// Rows of `got` vs `ref` (tp 1) within the tolerance; greedy tokens equal away from ties.
void expect_rows_near(const std::vector<float>& got, const std::vector<float>& ref, int64_t vocab,
                      const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t r = 0; r * vocab < ref.size(); ++r) {
    std::span<const float> g(got.data() + r * vocab, static_cast<size_t>(vocab));
    std::span<const float> f(ref.data() + r * vocab, static_cast<size_t>(vocab));
    double diff = 0.0;
    for (size_t i = 0; i < f.size(); ++i) {
      ASSERT_TRUE(std::isfinite(g[i])) << what << " row " << r << ": logit " << i << " is " << g[i];
      diff = std::max(diff, std::abs(static_cast<double>(g[i]) - f[i]));
    }
    const double scale = row_scale(f);
    g_worst = std::max(g_worst, diff / scale);
    EXPECT_LE(diff, kTpRelTol * scale) << what << " row " << r << ": max |tp2 - tp1| = " << diff;
    if (top2_gap(f) > 2 * kTpRelTol * scale)
      EXPECT_EQ(greedy_token(g), greedy_token(f)) << what << " row " << r << " (wide tp1 margin)";
  }
}


// Shapes (model_test_util.h): tiny (head_dim 16 padded to 64, GQA 2 -> 2/1 per rank), a Llama
// with q/k/v/o biases (o bias on rank 0 only), a Qwen2 with one kv head (tp 2 replicates it) and
// tied embeddings.

// Above kGpuHostRandomMaxParams: weights generated on the device (sharded init), padded heads
// (head_dim 32 -> 64), GQA, q/k/v/o biases.
ModelConfig big_device_random() {
  ModelConfig c = model_preset("tiny");
  c.hidden_size = 1024;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 4;
  c.head_dim = 32;
  c.intermediate_size = 2048;
  c.num_hidden_layers = 2;
  c.vocab_size = 32000;
  c.attention_bias = true;
  return c;
}

TpGpuModelOptions tp2(int prefill_chunk = kDefaultPrefillChunk) {
  TpGpuModelOptions o;
  o.tp = 2;
  o.model.prefill_chunk = prefill_chunk;
  o.model.validate_plans = true;
  o.timeout = std::chrono::milliseconds(30000);
  return o;
}

// Prefill (chunked, all logits, then a continuation over cached context) and three tree decode
// steps over forked paths: tp 2 against tp 1, logits and greedy tokens.
void compare_models(DecoderModel& one, DecoderModel& two, const std::string& what) {
  const int vocab = one.config().vocab_size;
  const Vec a = random_tokens(21, 1, vocab), b = random_tokens(7, 2, vocab);
  expect_rows_near(two.prefill(a, iota(0, 21), iota(0, 21), {}, true), one.prefill(a, iota(0, 21), iota(0, 21), {}, true),
                   vocab, what + " prefill a");
  expect_rows_near(two.prefill(b, iota(21, 7), iota(21, 7), iota(0, 21)),
                   one.prefill(b, iota(21, 7), iota(21, 7), iota(0, 21)), vocab, what + " prefill b (cached context)");
  // Three requests: two share a (and b), one has its own prompt.
  const Vec c = random_tokens(9, 3, vocab);
  (void)one.prefill(c, iota(0, 9), iota(100, 9), {});
  (void)two.prefill(c, iota(0, 9), iota(100, 9), {});
  std::vector<Vec> paths = {concat(iota(0, 21), iota(21, 7)), iota(0, 21), iota(100, 9)};
  Vec last = {b.back(), a.back(), c.back()};
  int32_t next = 200;
  for (int step = 0; step < 3; ++step) {
    Vec tokens = last, pos(3), slots(3);
    for (size_t p = 0; p < 3; ++p) {
      pos[p] = static_cast<int32_t>(paths[p].size());
      slots[p] = next++;
      paths[p].push_back(slots[p]);
    }
    const KvTree tree = kv_tree_from_paths(paths, PathSharing::kShared);
    const DecodeBatch batch{tokens, pos, slots, &tree};
    const std::vector<float> ref = one.decode(batch);
    expect_rows_near(two.decode(batch), ref, vocab, what + " decode step " + std::to_string(step));
    for (size_t p = 0; p < 3; ++p) last[p] = greedy_token(std::span<const float>(ref).subspan(p * vocab, vocab));
  }
}

std::vector<GenerationRequest> tree_requests(int vocab) {
  const Vec sys = random_tokens(24, 1, vocab), doc = random_tokens(10, 2, vocab);
  std::vector<GenerationRequest> reqs;
  auto add = [&](Vec prompt, int max_new, int n = 1) {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.max_new_tokens = max_new;
    r.n = n;
    reqs.push_back(r);
  };
  add(concat(sys, random_tokens(4, 10, vocab)), 9);
  add(concat(concat(sys, doc), random_tokens(3, 11, vocab)), 7);
  add(concat(concat(sys, doc), random_tokens(5, 12, vocab)), 10, 2);
  add(random_tokens(9, 13, vocab), 6);
  add(sys, 5);
  return reqs;
}


// Runs body(r) for ranks 0 and 1 at once (rank 1 on a second thread); each rank's exception
// message, "" for a rank that finished.
std::vector<std::string> on_two_ranks(const std::function<void(int)>& body) {
  std::vector<std::string> errors(2);
  auto run = [&](int r) {
    try {
      body(r);
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(r)] = e.what();
    }
  };
  {
    std::jthread t1(run, 1);
    run(0);
  }
  return errors;
}

// ---- NCCL ---------------------------------------------------------------------------------------

TEST(TpGpu, NcclAllReduceSumsFp32AndBf16) {
  SKIP_WITHOUT_TWO_GPUS();
  ASSERT_TRUE(nccl_available());
  const std::vector<int> devices = {0, 1};
  auto comms = NcclComm::create_group(devices);
  ASSERT_EQ(comms.size(), 2u);
  constexpr size_t n = 3000;
  std::vector<std::vector<float>> f32(2);
  std::vector<std::vector<uint16_t>> bf(2);
  const std::vector<std::string> errors = on_two_ranks([&](int r) {
    cuda_set_device(r);
    CudaStream stream;
    std::vector<float> x(n);
    std::vector<uint16_t> y(n);
    for (size_t i = 0; i < n; ++i) {
      x[i] = static_cast<float>(i % 97) * (r == 0 ? 1.0f : 0.5f) + static_cast<float>(r);
      y[i] = float_to_bf16(static_cast<float>(i % 13 + r));  // small integers: exact in bf16
    }
    DeviceBuffer dx(n * 4), dy(n * 2);
    copy_to_device(dx.data(), x.data(), n * 4, stream.get());
    copy_to_device(dy.data(), y.data(), n * 2, stream.get());
    NcclComm& c = *comms[static_cast<size_t>(r)];
    c.all_reduce_sum_fp32(dx.as<float>(), n, stream.get());
    c.all_reduce_sum_bf16(dy.data(), n, stream.get());
    c.wait(stream.get(), std::chrono::milliseconds(30000));
    copy_to_host(x.data(), dx.data(), n * 4, stream.get());
    copy_to_host(y.data(), dy.data(), n * 2, stream.get());
    stream.synchronize();
    f32[static_cast<size_t>(r)] = x;
    bf[static_cast<size_t>(r)] = y;
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < n; ++i) {
      const float want = static_cast<float>(i % 97) * 1.5f + 1.0f;
      ASSERT_EQ(f32[static_cast<size_t>(r)][i], want) << "rank " << r << " fp32 element " << i;
      ASSERT_EQ(bf16_to_float(bf[static_cast<size_t>(r)][i]), static_cast<float>(2 * (i % 13) + 1))
          << "rank " << r << " bf16 element " << i;
    }
  NcclComm::destroy_group(comms);
}

TEST(TpGpu, NcclPeerThatSkipsACollectiveTimesOutWithAnError) {
  SKIP_WITHOUT_TWO_GPUS();
  const std::vector<int> devices = {0, 1};
  // The communicators' timeout (init and enqueue) is 2 s here.
  auto comms = NcclComm::create_group(devices, std::chrono::milliseconds(2000));
  cuda_set_device(0);
  CudaStream stream;
  DeviceBuffer buf(1024 * 4);
  memset_device(buf.data(), 0, buf.bytes(), stream.get());
  const auto t0 = Clock::now();
  // Rank 1 never joins. NCCL connects peers lazily at the first collective, so the non-blocking
  // enqueue itself may be what waits (measured on the H200 pair); either it or the wait must end
  // with the timeout error.
  expect_error(
      [&] {
        comms[0]->all_reduce_sum_fp32(buf.as<float>(), 1024, stream.get());
        comms[0]->wait(stream.get(), std::chrono::milliseconds(2000));
      },
      {"NCCL rank 0 of 2", "did not finish within 2000 ms", "aborted"});
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(s, 30.0) << "the wait must end near its timeout";
  EXPECT_TRUE(comms[0]->aborted());
  stream.synchronize();  // the aborted collective no longer holds the stream
  expect_error([&] { comms[0]->all_reduce_sum_fp32(buf.as<float>(), 1024, stream.get()); }, {"aborted communicator"});
  // A peer's request (another thread) makes the owner's next wait fail at once.
  comms[1]->request_abort("test: peer failed");
  cuda_set_device(1);
  CudaStream s1;
  expect_error([&] { comms[1]->wait(s1.get(), std::chrono::milliseconds(60000)); }, {"test: peer failed"});
  NcclComm::destroy_group(comms);
}

// Symmetric windows (ncclMemAlloc + ncclCommWindowRegister): an in-place fp32 all-reduce on the
// windows sums exactly; the windows are released with the group. Skips (printing why) on a host
// where NCCL cannot make them (create_symmetric_windows returns the reason).
TEST(TpGpu, NcclSymmetricWindowsSumInPlace) {
  SKIP_WITHOUT_TWO_GPUS();
  const std::vector<int> devices = {0, 1};
  auto comms = NcclComm::create_group(devices);
  constexpr size_t n = (size_t{3} << 20) / 4 + 123;  // 3 MB + a ragged tail
  const std::string why = NcclComm::create_symmetric_windows(comms, n * 4);
  if (!why.empty()) {
    NcclComm::destroy_group(comms);
    GTEST_SKIP() << "no symmetric windows on this host: " << why;
  }
  std::vector<std::vector<float>> got(2);
  const std::vector<std::string> errors = on_two_ranks([&](int r) {
    cuda_set_device(r);
    CudaStream stream;
    NcclComm& c = *comms[static_cast<size_t>(r)];
    if (c.window() == nullptr || c.window_bytes() < n * 4) throw std::runtime_error("window missing or short");
    std::vector<float> x(n);
    for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 1013) * (r == 0 ? 0.25f : 2.0f) - static_cast<float>(r);
    float* w = static_cast<float*>(c.window());
    copy_to_device(w, x.data(), n * 4, stream.get());
    for (int rep = 0; rep < 3; ++rep) {  // repeated: the second and third sum the previous sums
      c.all_reduce_sum_fp32(w, n, stream.get());
      c.wait(stream.get(), std::chrono::milliseconds(30000));
    }
    copy_to_host(x.data(), w, n * 4, stream.get());
    stream.synchronize();
    got[static_cast<size_t>(r)] = x;
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  for (int r = 0; r < 2; ++r)
    for (size_t i = 0; i < n; ++i) {
      const float once = static_cast<float>(i % 1013) * 2.25f - 1.0f;  // exact in fp32
      ASSERT_EQ(got[static_cast<size_t>(r)][i], once * 4.0f) << "rank " << r << " element " << i;
    }
  NcclComm::destroy_group(comms);
}

// P2P one-shot all-reduce (cuda/p2p_all_reduce.h): exact in-place sums, repeated (the per-block
// epochs advance), every size class of the kernel; a peer that never arrives makes the kernel give
// up after its timeout (check() throws, no hang), and abort() ends a waiting kernel at once.
TEST(TpGpu, P2pAllReduceSumsAndGivesUpWithoutAPeer) {
  SKIP_WITHOUT_TWO_GPUS();
  const std::vector<int> devices = {0, 1};
  std::string why;
  auto group = P2pAllReduce::create_group(devices, size_t{8} << 20, std::chrono::milliseconds(1500), &why);
  if (group.empty()) GTEST_SKIP() << "no peer access: " << why;
  ASSERT_EQ(group.size(), 2u);
  EXPECT_EQ(group[0]->max_count(), (size_t{8} << 20) / 4);
  EXPECT_FALSE(group[0]->accepts(group[0]->buffer(), 6));                       // not a multiple of 4
  EXPECT_FALSE(group[0]->accepts(group[0]->buffer() + 4, 8));                   // not the buffer
  EXPECT_FALSE(group[0]->accepts(group[0]->buffer(), group[0]->max_count() + 4));
  const std::vector<size_t> counts = {4, 1000, 65536 * 4 + 12, size_t{1} << 20, group[0]->max_count()};
  const std::vector<std::string> errors = on_two_ranks([&](int r) {
    cuda_set_device(r);
    CudaStream stream;
    P2pAllReduce& g = *group[static_cast<size_t>(r)];
    for (size_t n : counts) {
      std::vector<float> x(n);
      for (size_t i = 0; i < n; ++i) x[i] = static_cast<float>(i % 1021) * (r == 0 ? 0.5f : 3.0f) + static_cast<float>(r);
      copy_to_device(g.buffer(), x.data(), n * 4, stream.get());
      for (int rep = 0; rep < 2; ++rep) g.all_reduce_sum_fp32(g.buffer(), n, stream.get());
      copy_to_host(x.data(), g.buffer(), n * 4, stream.get());
      stream.synchronize();
      g.check();
      for (size_t i = 0; i < n; ++i) {
        const float once = static_cast<float>(i % 1021) * 3.5f + 1.0f;  // exact in fp32
        if (x[i] != once * 2.0f)
          throw std::runtime_error("count " + std::to_string(n) + " element " + std::to_string(i) + ": " +
                                   std::to_string(x[i]) + " != " + std::to_string(once * 2.0f));
      }
    }
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  // Rank 1 never joins: rank 0's kernel gives up after 1.5 s and leaves its buffer unchanged.
  // (A wait reads the host abort flag only after 1 ms, so abort() below takes effect within ~1 ms.)
  cuda_set_device(0);
  CudaStream stream;
  const std::vector<float> mine(64, 2.5f);
  copy_to_device(group[0]->buffer(), mine.data(), 64 * 4, stream.get());
  const auto t0 = Clock::now();
  group[0]->all_reduce_sum_fp32(group[0]->buffer(), 64, stream.get());
  stream.synchronize();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 20.0);
  expect_error([&] { group[0]->check(); }, {"P2P all-reduce rank 0 of 2", "did not reach the all-reduce within 1500 ms"});
  std::vector<float> back(64);
  copy_to_host(back.data(), group[0]->buffer(), 64 * 4, stream.get());
  stream.synchronize();
  EXPECT_EQ(back, mine);
  // abort() from another thread ends a kernel that would otherwise wait its whole timeout.
  auto slow = P2pAllReduce::create_group(devices, 4096, std::chrono::milliseconds(600000), &why);
  ASSERT_EQ(slow.size(), 2u);
  const auto t1 = Clock::now();
  slow[0]->all_reduce_sum_fp32(slow[0]->buffer(), 64, stream.get());
  std::jthread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    slow[1]->abort();
  });
  stream.synchronize();
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t1).count(), 20.0);
  expect_error([&] { slow[0]->check(); }, {"did not reach the all-reduce"});
  EXPECT_TRUE(slow[0]->aborted());
  expect_error([&] { slow[0]->all_reduce_sum_fp32(slow[0]->buffer(), 64, stream.get()); }, {"after the group was aborted"});
}

// Timing (run explicitly: --gtest_also_run_disabled_tests): microseconds per in-place all-reduce on
// 2 GPUs, 300 back-to-back calls per rank after 30 of warm-up, wall time of both ranks / calls:
// plain NCCL, NCCL on symmetric windows (fp32 and bf16) and the P2P one-shot kernel.
TEST(TpGpu, DISABLED_AllReduceTimings) {
  SKIP_WITHOUT_TWO_GPUS();
  const std::vector<int> devices = {0, 1};
  auto comms = NcclComm::create_group(devices);
  const std::string why = NcclComm::create_symmetric_windows(comms, size_t{8} << 20);
  std::string p2p_why;
  auto p2p = P2pAllReduce::create_group(devices, size_t{8} << 20, std::chrono::milliseconds(30000), &p2p_why);
  std::cout << "[ timing ] windows: " << (why.empty() ? "yes" : why) << "; p2p: " << (p2p.empty() ? p2p_why : "yes") << "\n";
  for (size_t bytes : {size_t{256} << 10, size_t{1} << 20, size_t{2} << 20, size_t{8} << 20}) {
    for (int kind = 0; kind < 5; ++kind) {  // 0 plain fp32, 1 plain bf16, 2 window fp32, 3 window bf16, 4 p2p
      if ((kind == 2 || kind == 3) && !why.empty()) continue;
      if (kind == 4 && p2p.empty()) continue;
      std::vector<double> us(2, 0.0);
      std::atomic<int> ready{0};
      const std::vector<std::string> errors = on_two_ranks([&](int r) {
        cuda_set_device(r);
        CudaStream stream;
        DeviceBuffer own(bytes);
        void* data = own.data();
        if (kind == 2 || kind == 3) data = comms[static_cast<size_t>(r)]->window();
        if (kind == 4) data = p2p[static_cast<size_t>(r)]->buffer();
        memset_device(data, 0, bytes, stream.get());
        auto once = [&] {
          if (kind == 4) p2p[static_cast<size_t>(r)]->all_reduce_sum_fp32(static_cast<float*>(data), bytes / 4, stream.get());
          else if (kind == 1 || kind == 3) comms[static_cast<size_t>(r)]->all_reduce_sum_bf16(data, bytes / 2, stream.get());
          else comms[static_cast<size_t>(r)]->all_reduce_sum_fp32(static_cast<float*>(data), bytes / 4, stream.get());
        };
        for (int i = 0; i < 30; ++i) once();
        comms[static_cast<size_t>(r)]->wait(stream.get(), std::chrono::milliseconds(30000));
        ready.fetch_add(1);
        while (ready.load() < 2) std::this_thread::yield();
        const auto t0 = Clock::now();
        for (int i = 0; i < 300; ++i) once();
        comms[static_cast<size_t>(r)]->wait(stream.get(), std::chrono::milliseconds(30000));
        us[static_cast<size_t>(r)] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / 300;
        if (kind == 4) p2p[static_cast<size_t>(r)]->check();
      });
      ASSERT_EQ(errors[0], "");
      ASSERT_EQ(errors[1], "");
      static const char* names[] = {"nccl fp32", "nccl bf16", "nccl window fp32", "nccl window bf16", "p2p fp32"};
      std::cout << "[ timing ] " << (bytes >> 10) << " KiB " << names[kind] << ": " << std::max(us[0], us[1]) << " us\n";
    }
  }
  p2p.clear();
  NcclComm::destroy_group(comms);
}

// The same model on plain NCCL buffers, on symmetric windows and on the P2P one-shot all-reduce
// gives bit-identical logits (a sum of two fp32 values does not depend on the kernel that computes
// it), also for a decode batch of more rows than the window holds (those calls fall back to the
// model's own buffer and NCCL).
TEST(TpGpu, SymmetricWindowsAndP2pGiveTheLogitsOfPlainBuffers) {
  SKIP_WITHOUT_TWO_GPUS();
  const ModelConfig c = model_preset("tiny");
  const ModelWeights w = random_weights(c, 79);
  TpGpuModelOptions plain_opt = tp2(8), sym_opt = tp2(8), p2p_opt = tp2(8);
  plain_opt.symmetric_windows = false;
  plain_opt.p2p_all_reduce = false;
  sym_opt.p2p_all_reduce = false;
  p2p_opt.p2p_all_reduce = true;
  TpGpuModel plain(w, 4096, plain_opt), sym(w, 4096, sym_opt), p2p(w, 4096, p2p_opt);
  std::cout << "[ tp gpu ] all-reduce: " << sym.all_reduce_path() << "; " << p2p.all_reduce_path() << "\n";
  EXPECT_EQ(plain.all_reduce_path(), "nccl (symmetric windows off)");
  const int vocab = c.vocab_size;
  const Vec a = random_tokens(21, 4, vocab);
  const std::vector<float> ref = plain.prefill(a, iota(0, 21), iota(0, 21), {}, true);
  EXPECT_EQ(sym.prefill(a, iota(0, 21), iota(0, 21), {}, true), ref);
  EXPECT_EQ(p2p.prefill(a, iota(0, 21), iota(0, 21), {}, true), ref);
  for (int32_t b : {3, kTpWindowMinRows + 6}) {  // fits the window / does not
    SCOPED_TRACE("decode batch " + std::to_string(b));
    std::vector<Vec> paths;
    Vec tokens, pos, slots;
    for (int32_t i = 0; i < b; ++i) {
      Vec p = iota(0, 21);
      p.push_back(21 + i);
      paths.push_back(p);
      tokens.push_back(a[static_cast<size_t>(i % 21)]);
      pos.push_back(21);
      slots.push_back(21 + i);
    }
    const KvTree tree = kv_tree_from_paths(paths, PathSharing::kShared);
    const DecodeBatch batch{tokens, pos, slots, &tree};
    const std::vector<float> want = plain.decode(batch);
    EXPECT_EQ(sym.decode(batch), want);
    EXPECT_EQ(p2p.decode(batch), want);
  }
}

// ---- tp 2 vs tp 1 -------------------------------------------------------------------------------

TEST(TpGpu, MatchesTp1OnHostWeights) {
  SKIP_WITHOUT_TWO_GPUS();
  g_worst = 0.0;
  for (const ModelConfig& c : {model_preset("tiny"), llama_bias64(), qwen64()}) {
    SCOPED_TRACE(c.model_type + " Hkv " + std::to_string(c.num_key_value_heads));
    const ModelWeights w = random_weights(c, 77);
    GpuModel one(w, 512);
    TpGpuModel two(w, 512, tp2(8));  // 8-token prefill chunks
    EXPECT_EQ(two.tp(), 2);
    EXPECT_EQ(two.num_slots(), 512);
    EXPECT_EQ(two.local_config().num_attention_heads, c.num_attention_heads / 2);
    compare_models(one, two, c.model_type);
  }
  std::cout << "[ tp gpu ] host weights: worst max|tp2 - tp1| / max(1, max|logit|) = " << g_worst << " (tolerance "
            << kTpRelTol << ")\n";
}

TEST(TpGpu, MatchesTp1OnDeviceRandomWeights) {
  SKIP_WITHOUT_TWO_GPUS();
  g_worst = 0.0;
  for (const ModelConfig& c : {model_preset("tiny"), big_device_random()}) {
    SCOPED_TRACE("hidden " + std::to_string(c.hidden_size));
    GpuModel one(c, 9, 512);
    TpGpuModel two(c, 9, 512, tp2());
    compare_models(one, two, "preset seed 9");
    // Another seed is another model (the shards follow the seed).
    TpGpuModel other(c, 10, 512, tp2());
    const Vec p = random_tokens(5, 4, c.vocab_size);
    EXPECT_NE(other.prefill(p, iota(0, 5), iota(0, 5), {}), two.prefill(p, iota(0, 5), iota(300, 5), {}));
  }
  std::cout << "[ tp gpu ] device random weights: worst ratio " << g_worst << " (tolerance " << kTpRelTol << ")\n";
}

TEST(TpGpu, MatchesTp1OnGoldenCheckpoints) {
  SKIP_WITHOUT_TWO_GPUS();
  const std::vector<std::string> dirs = test::golden_dirs();
  ASSERT_FALSE(dirs.empty());
  g_worst = 0.0;
  int compared = 0;
  for (const std::string& dir : dirs) {
    SCOPED_TRACE(dir);
    const ModelConfig config = load_model_config(dir);
    const SafetensorsFolder folder(dir);
    const ModelWeights w = load_weights(folder, config);
    GpuModel one(folder, config, 512);
    TpGpuModel two(w, 512, tp2());
    compare_models(one, two, dir);
    ++compared;
    // make_model --tp 2 with a checkpoint folder: each rank loads its blocks (load_gpu_weights_shard), same logits.
    ModelSpec spec;
    spec.model_dir = dir;
    spec.backend = "cuda";
    spec.kv_slots = 64;
    spec.tp = 2;
    auto made = make_model(spec);
    ASSERT_NE(dynamic_cast<TpGpuModel*>(made.get()), nullptr);
    const Vec p = random_tokens(6, 5, config.vocab_size);
    expect_rows_near(made->prefill(p, iota(0, 6), iota(0, 6), {}), one.prefill(p, iota(0, 6), iota(400, 6), {}),
                     config.vocab_size, "make_model tp 2");
  }
  std::cout << "[ tp gpu ] " << compared << " golden checkpoints: worst ratio " << g_worst << " (tolerance "
            << kTpRelTol << ")\n";
}

TEST(TpGpu, SchedulerFastTreeAndPerRequestGiveTheSameTokens) {
  SKIP_WITHOUT_TWO_GPUS();
  for (const ModelConfig& c : {model_preset("tiny"), llama_bias64()}) {
    SCOPED_TRACE(c.model_type);
    const ModelWeights w = random_weights(c, 77);
    const auto reqs = tree_requests(c.vocab_size);
    TpGpuModel two(w, 1024, tp2());
    two.set_profiling(true);
    const auto shared = run_scheduler(two, reqs, PathSharing::kShared);
    const DecodeTimes t = two.decode_times();
    EXPECT_GT(t.steps, 0);
    EXPECT_GT(t.gemm_ms, 0.0);
    EXPECT_GT(t.attention_ms, 0.0);
    EXPECT_GT(t.comm_ms, 0.0) << "the all-reduces are timed";
    EXPECT_LE(t.attention_ms + t.gemm_ms + t.other_ms + t.comm_ms, t.total_ms * 1.05 + 1.0);
    two.set_profiling(false);
    two.reset_times();
    EXPECT_EQ(two.decode_times().steps, 0);
    const auto per_request = run_scheduler(two, reqs, PathSharing::kPerRequest);
    EXPECT_EQ(two.replica_mismatches(), 0) << "replicated LM heads must agree";
    ASSERT_EQ(shared.size(), reqs.size());
    ASSERT_EQ(per_request.size(), reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(shared[i].samples, per_request[i].samples) << "request " << i;
    // Against tp 1: where tokens differ, tp 1's own logits at that position must be a near tie.
    GpuModel one(w, 1024);
    const auto ref = run_scheduler(one, reqs, PathSharing::kShared);
    CpuModel cpu(w, 1024);
    int ties = 0;
    for (size_t i = 0; i < reqs.size(); ++i)
      for (size_t s = 0; s < ref[i].samples.size(); ++s) {
        const Vec& a = ref[i].samples[s];
        const Vec& b = shared[i].samples[s];
        size_t k = 0;
        while (k < a.size() && a[k] == b[k]) ++k;
        if (k == a.size()) continue;
        ++ties;
        const Vec seq = concat(reqs[i].prompt, Vec(a.begin(), a.begin() + static_cast<long>(k)));
        const int32_t n = static_cast<int32_t>(seq.size());
        const std::vector<float> logits = cpu.prefill(seq, iota(0, n), iota(0, n), {});
        // The fp32 CPU logits: 2 x the TP tolerance plus 2 x the bf16-vs-fp32 tolerance of the GPU
        // model (tests/test_engine_gpu.cpp, 0.05) of the same prefix.
        EXPECT_LE(std::abs(logits[static_cast<size_t>(a[k])] - logits[static_cast<size_t>(b[k])]),
                  (2 * kTpRelTol + 2 * 0.05) * row_scale(logits))
            << "request " << i << " sample " << s << " diverges at token " << k << " where the margin is wide";
      }
    std::cout << "[ tp gpu ] " << c.model_type << ": " << ties << " samples diverge from tp 1 (at near ties)\n";
  }
}

// Greedy decode steps replay a CUDA graph per rank (NCCL all-reduces captured) from the second
// step with the same batch: the tokens equal those of eager steps (decode_graphs off) exactly, for
// shared and per-request trees, and the replicated LM heads agree.
TEST(TpGpu, DecodeGraphsGiveTheTokensOfEagerSteps) {
  SKIP_WITHOUT_TWO_GPUS();
  const ModelConfig c = model_preset("tiny");
  const ModelWeights w = random_weights(c, 78);
  const auto reqs = tree_requests(c.vocab_size);
  TpGpuModelOptions eager_opt = tp2();
  eager_opt.model.decode_graphs = false;
  TpGpuModel graphs(w, 1024, tp2()), eager(w, 1024, eager_opt);
  for (PathSharing sharing : {PathSharing::kShared, PathSharing::kPerRequest}) {
    const auto a = run_scheduler(graphs, reqs, sharing);
    const auto b = run_scheduler(eager, reqs, sharing);
    ASSERT_EQ(a.size(), reqs.size());
    for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(a[i].samples, b[i].samples) << "request " << i;
  }
  EXPECT_EQ(graphs.replica_mismatches(), 0);
}

// Workloads A-D (scale 1/8, lengths 1/16) on llama2-7b's shape (random weights), 8 greedy tokens per
// sample through the Scheduler (FastTree): tp 2 against tp 1. First-token logits (prefill) within
// kTpRelTol; a sample whose tokens differ must do so at a tie of tp 1's logits:
// logit[tp1 token] - logit[tp2 token] <= kTpRelTol * max(1, |top logit|) (bench-e2e's --tie-tol).
TEST(TpGpu, Llama7bWorkloadsFirstStepsMatchTp1) {
  SKIP_WITHOUT_TWO_GPUS();
  const ModelConfig c = model_preset("llama2-7b");
  g_worst = 0.0;
  int64_t samples = 0, equal = 0, ties = 0;
  for (const std::string wl : {"A", "B", "C", "D"}) {
    SCOPED_TRACE("workload " + wl);
    WorkloadSpec spec;
    spec.name = wl;
    spec.vocab_size = c.vocab_size;
    spec.max_new_tokens = 8;
    spec.scale = 1.0 / 8;
    spec.length_scale = 1.0 / 16;
    const std::vector<GenerationRequest> reqs = make_workload(spec);
    const int64_t slots = workload_stats(reqs).kv_slots_all_at_once();
    // Every sample's logits at every index (tp 1), and the first-token logits of tp 2.
    std::map<std::pair<int64_t, int>, std::vector<std::vector<float>>> ref_logits;
    std::map<std::pair<int64_t, int>, std::vector<float>> first_tp2;
    auto run = [&](DecoderModel& m, bool keep_all) {
      SchedulerOptions o;
      o.sharing = PathSharing::kShared;
      o.on_token_logits = [&](const TokenLogits& t) {
        const auto key = std::make_pair(t.request_id, t.sample);
        if (keep_all) {
          auto& v = ref_logits[key];
          if (static_cast<int64_t>(v.size()) <= t.index) v.resize(static_cast<size_t>(t.index) + 1);
          v[static_cast<size_t>(t.index)].assign(t.logits.begin(), t.logits.end());
        } else if (t.index == 0) {
          first_tp2[key].assign(t.logits.begin(), t.logits.end());
        }
      };
      Scheduler s(m, o);
      for (const auto& r : reqs) s.submit(r);
      return s.run();
    };
    std::vector<GenerationResult> one_out, two_out;
    {
      GpuModel one(c, 0, static_cast<int32_t>(slots));
      one_out = run(one, true);
    }
    {
      TpGpuModel two(c, 0, static_cast<int32_t>(slots), tp2());
      two_out = run(two, false);
    }
    ASSERT_EQ(one_out.size(), two_out.size());
    for (size_t i = 0; i < one_out.size(); ++i)
      for (size_t k = 0; k < one_out[i].samples.size(); ++k) {
        ++samples;
        const auto key = std::make_pair(static_cast<int64_t>(i), static_cast<int>(k));
        const auto& ref = ref_logits.at(key);
        expect_rows_near(first_tp2.at(key), ref[0], c.vocab_size,
                         "request " + std::to_string(i) + " sample " + std::to_string(k) + " first token");
        const Vec& a = one_out[i].samples[k];
        const Vec& b = two_out[i].samples[k];
        ASSERT_EQ(a.size(), b.size());
        size_t j = 0;
        while (j < a.size() && a[j] == b[j]) ++j;
        if (j == a.size()) {
          ++equal;
          continue;
        }
        ++ties;
        const std::vector<float>& row = ref[j];
        const double top = *std::max_element(row.begin(), row.end());
        EXPECT_LE(row[static_cast<size_t>(a[j])] - row[static_cast<size_t>(b[j])], kTpRelTol * std::max(1.0, std::abs(top)))
            << "request " << i << " sample " << k << " diverges at token " << j << " beyond a bf16 tie";
      }
  }
  std::cout << "[ tp gpu ] llama2-7b workloads A-D: " << equal << "/" << samples
            << " samples equal over 8 tokens, " << ties << " diverge at ties; worst first-token logit ratio " << g_worst
            << " (tolerance " << kTpRelTol << ")\n";
}

// ---- failures -----------------------------------------------------------------------------------

TEST(TpGpu, FailingRankEndsTheCallOnEveryRankWithoutHang) {
  SKIP_WITHOUT_TWO_GPUS();
  const ModelConfig c = model_preset("tiny");
  const ModelWeights w = random_weights(c, 3);
  TpGpuModelOptions o = tp2();
  o.timeout = std::chrono::milliseconds(20000);
  o.before_all_reduce = [](int rank, int64_t index) {
    if (rank == 1 && index == 2) FT_FAIL("injected failure");
  };
  TpGpuModel model(w, 64, o);
  const Vec p = random_tokens(5, 1, c.vocab_size);
  const auto t0 = Clock::now();
  expect_error([&] { model.prefill(p, iota(0, 5), iota(0, 5), {}); }, {"rank 1", "injected failure"});
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 15.0) << "peers must not wait for the timeout";
  ASSERT_EQ(model.last_rank_errors().size(), 2u);
  EXPECT_NE(model.last_rank_errors()[1].find("injected failure"), std::string::npos);
  EXPECT_NE(model.last_rank_errors()[0], "") << "rank 0 must stop too";
  expect_error([&] { model.prefill(p, iota(0, 5), iota(0, 5), {}); }, {"unusable", "rank 1"});
}

TEST(TpGpu, StalledRankTimesOutWithAnError) {
  SKIP_WITHOUT_TWO_GPUS();
  const ModelConfig c = model_preset("tiny");
  TpGpuModelOptions o = tp2();
  o.timeout = std::chrono::milliseconds(2000);
  o.before_all_reduce = [](int rank, int64_t index) {
    if (rank == 1 && index == 1) std::this_thread::sleep_for(std::chrono::milliseconds(6000));
  };
  TpGpuModel model(c, 1, 64, o);
  const Vec p = random_tokens(5, 1, c.vocab_size);
  const auto t0 = Clock::now();
  expect_error([&] { model.prefill(p, iota(0, 5), iota(0, 5), {}); }, {"tensor-parallel step failed", "within 2000 ms"});
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 30.0);
}

TEST(TpGpu, BadInputIsRejectedAndTheModelKeepsWorking) {
  SKIP_WITHOUT_TWO_GPUS();
  const ModelConfig c = model_preset("tiny");
  TpGpuModel model(c, 1, 64, tp2());
  expect_error([&] { model.prefill(Vec{static_cast<int32_t>(c.vocab_size)}, Vec{0}, Vec{0}, {}); }, {"outside the vocabulary"});
  expect_error([&] { model.prefill(Vec{1}, Vec{0}, Vec{64}, {}); }, {"slot 64", "out of range"});
  const Vec p = random_tokens(5, 1, c.vocab_size);
  GpuModel one(c, 1, 64);
  expect_rows_near(model.prefill(p, iota(0, 5), iota(0, 5), {}), one.prefill(p, iota(0, 5), iota(0, 5), {}),
                   c.vocab_size, "after bad input");
}

#endif  // FASTTREE_HAVE_CUDA

// ---- everywhere ---------------------------------------------------------------------------------

TEST(TpGpuHost, TpOnTheCpuBackendRunsTheCpuTensorParallelModel) {
  ModelSpec spec;
  spec.preset = "tiny";
  spec.backend = "cpu";
  spec.kv_slots = 64;
  spec.threads = 2;
  auto one = make_model(spec);
  spec.tp = 2;
  auto two = make_model(spec);
  const Vec p = random_tokens(7, 1, 256);
  const std::vector<float> a = one->prefill(p, iota(0, 7), iota(0, 7), {});
  const std::vector<float> b = two->prefill(p, iota(0, 7), iota(0, 7), {});
  ASSERT_EQ(a.size(), b.size());
  double diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff = std::max(diff, static_cast<double>(std::abs(a[i] - b[i])));
  EXPECT_LT(diff, 1e-4);
}

TEST(TpGpuHost, HeadsThatDoNotSplitAreAClearError) {
  for (const std::string backend : {"cpu", "cuda"}) {
    ModelSpec spec;
    spec.preset = "tiny";  // 4 heads
    spec.backend = backend;
    spec.kv_slots = 64;
    spec.tp = 3;
    expect_error([&] { make_model(spec); }, {"4 attention heads cannot be split over tp 3"});
    spec.tp = 0;
    expect_error([&] { make_model(spec); }, {"--tp must be at least 1"});
  }
  TpGpuModelOptions o;
  o.tp = 3;
  expect_error([&] { TpGpuModel(model_preset("tiny"), 0, 64, o); }, {"cannot be split over tp 3"});
  ModelConfig c = model_preset("tiny");
  c.intermediate_size = 130;
  o.tp = 4;
  expect_error([&] { TpGpuModel(c, 0, 64, o); }, {"intermediate_size 130 is not a multiple of tp 4"});
}

TEST(TpGpuHost, MoreRanksThanGpusIsAClearError) {
  const int visible = cuda_device_count();
  if (visible >= 4) GTEST_SKIP() << visible << " devices: tp 4 would run";
  ModelSpec spec;
  spec.preset = "tiny";  // 4 heads, 2 kv heads: tp 4 splits (kv heads replicated)
  spec.backend = "cuda";
  spec.kv_slots = 64;
  spec.tp = 4;
  if (!cuda_backend_built()) {
    expect_error([&] { make_model(spec); }, {"built without the CUDA backend"});
    return;
  }
  expect_error([&] { make_model(spec); }, {"--tp 4 needs 4 GPUs", std::to_string(visible) + " CUDA device"});
  TpGpuModelOptions o;
  o.tp = 4;
  expect_error([&] { TpGpuModel(model_preset("tiny"), 0, 64, o); }, {"tp 4 needs 4 GPUs", "is missing"});
}

// `fasttree generate --tp`: one-line errors for a split that does not work, more ranks than GPUs,
// and the CPU tensor-parallel path giving the same greedy tokens as --tp 1.
TEST(TpGpuHost, GenerateCliTpOption) {
  const std::string dir = std::filesystem::temp_directory_path().string() + "/fasttree_tp_cli_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  auto run = [&](const std::string& args, std::string& out, std::string& err) {
    const std::string cmd = "cd '" + dir + "' && " + cli_path() + " generate --preset tiny --prompt-ids 1,2,3,4 " +
                            "--max-new-tokens 5 --threads 2 " + args + " >out.txt 2>err.txt";
    const int status = std::system(cmd.c_str());
    auto slurp = [&](const std::string& f) {
      std::ifstream in(dir + "/" + f, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    out = slurp("out.txt");
    err = slurp("err.txt");
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  std::string out, err, out1, err1;
  EXPECT_GT(run("--backend cpu --tp 3", out, err), 0);
  EXPECT_NE(err.find("4 attention heads cannot be split over tp 3"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
  if (cuda_device_count() < 4) {
    EXPECT_GT(run("--backend cuda --tp 4", out, err), 0);
    EXPECT_NE(err.find(cuda_backend_built() ? "--tp 4 needs 4 GPUs" : "without the CUDA backend"), std::string::npos)
        << err;
  }
  ASSERT_EQ(run("--backend cpu --tp 2", out, err), 0) << err;
  ASSERT_EQ(run("--backend cpu --tp 1", out1, err1), 0) << err1;
  EXPECT_EQ(out, out1);  // fp32 CPU ranks: the same greedy tokens
  std::filesystem::remove_all(dir);
}

TEST(TpGpuHost, Llama70bPresetSplitsOverTwoAndEightRanks) {
  const ModelConfig c = model_preset("llama2-70b");
  EXPECT_EQ(c.num_hidden_layers, 80);
  EXPECT_EQ(c.hidden_size, 8192);
  EXPECT_EQ(c.intermediate_size, 28672);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_NEAR(static_cast<double>(c.num_params()), 69.0e9, 0.5e9);
  const ModelConfig l2 = tp_local_config(c, 2);
  EXPECT_EQ(l2.num_attention_heads, 32);
  EXPECT_EQ(l2.num_key_value_heads, 4);
  EXPECT_EQ(l2.intermediate_size, 14336);
  // One rank's bf16 shard (embedding and LM head replicated) fits an H200 (141 GB) with room for KV.
  EXPECT_LT(2.0 * static_cast<double>(l2.num_params()), 75e9);
  EXPECT_EQ(tp_local_config(c, 8).num_key_value_heads, 1);
}

}  // namespace
}  // namespace fasttree
