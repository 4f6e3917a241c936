// Built instead of p2p_all_reduce.cpp when nvcc is absent: there is no device, so no group.
#include "core/error.h"
#include "cuda/p2p_all_reduce.h"

namespace fasttree {

struct P2pAllReduce::Shared {};
struct P2pAllReduce::Impl {};

namespace {
[[noreturn]] void not_built() { FT_FAIL("P2P all-reduce: this binary was built without the CUDA backend (no nvcc)"); }
}  // namespace

P2pAllReduce::P2pAllReduce(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
P2pAllReduce::~P2pAllReduce() = default;
std::vector<std::unique_ptr<P2pAllReduce>> P2pAllReduce::create_group(std::span<const int>, size_t,
                                                                      std::chrono::milliseconds, std::string* why) {
  if (why != nullptr) *why = "built without the CUDA backend";
  return {};
}
int P2pAllReduce::rank() const { not_built(); }
float* P2pAllReduce::buffer() const { not_built(); }
size_t P2pAllReduce::buffer_bytes() const { not_built(); }
size_t P2pAllReduce::max_count() const { not_built(); }
bool P2pAllReduce::accepts(const float*, size_t) const { not_built(); }
void P2pAllReduce::all_reduce_sum_fp32(float*, size_t, CUstream_st*) { not_built(); }
void P2pAllReduce::check() const { not_built(); }
void P2pAllReduce::abort() noexcept {}
bool P2pAllReduce::aborted() const { not_built(); }

}  // namespace fasttree
