// Per-CTA timeline marks of the attention kernels (diagnostics). Compiled in only with
// -DFT_TRACE=1 (CMake: -DFASTTREE_TRACE=ON, a separate build): then a kernel whose params carry a
// trace buffer (TreeAttnParams::trace / MergeParams::trace, device_plan.h) writes the SM's
// %globaltimer (ns) at fixed points; a production build compiles every mark to nothing.
#pragma once
#include <cstdint>

#include "cuda/device_plan.h"

namespace fasttree::cuda_detail {

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Mark `event` of this CTA in kernel `kind` (TraceKind); later marks of the same event overwrite.
__device__ __forceinline__ void trace_mark(unsigned long long* trace, int kind, int event) {
  if constexpr (FT_TRACE) {
    if (trace != nullptr && blockIdx.x < kTraceCtas)
      trace[(static_cast<int64_t>(kind) * kTraceCtas + blockIdx.x) * kTraceEvents + event] = globaltimer_ns();
  }
}

// Stores `value` into slot `event` of this CTA (sums of durations and counts, accumulated in
// registers by the caller and stored once at the end: a read-modify-write of global memory per
// tile would put a memory round trip on the very path being measured).
__device__ __forceinline__ void trace_put(unsigned long long* trace, int kind, int event, uint64_t value) {
  if constexpr (FT_TRACE) {
    if (trace != nullptr && blockIdx.x < kTraceCtas)
      trace[(static_cast<int64_t>(kind) * kTraceCtas + blockIdx.x) * kTraceEvents + event] = value;
  }
}

}  // namespace fasttree::cuda_detail
