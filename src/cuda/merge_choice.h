// Choice between the two separate merge kernels (merge_kernel.cuh) for an uploaded plan. Host code
// only (no CUDA header), so that the rule is unit-tested on machines without a GPU.
#pragma once
#include <cstdint>

#include "cuda/kernels.h"

namespace fasttree::cuda_detail {

// Which separate merge kernel has the shorter chain of dependent L2 round trips for a plan of
// `jobs` (query, head) jobs averaging rows / queries partial rows each, on `grid` CTAs: the lane-group
// kernel takes kMergeStep rows per round trip and holds grid x kMergeThreads / (d / 8) jobs at a time,
// the wide one splits a job's rows over a CTA's lane groups (one job per CTA at a time) and pays a
// barrier and a shared-memory combine per job (counted as half a round trip).
inline bool prefer_wide_merge(int64_t jobs, int64_t rows, int64_t queries, int64_t grid, int head_dim) {
  if (jobs <= 0 || queries <= 0 || grid <= 0 || head_dim < 8 || head_dim > 8 * kMergeThreads) return false;
  const int64_t lanes_per_job = head_dim / 8, groups = kMergeThreads / lanes_per_job;
  const int64_t per_job = (rows + queries - 1) / queries;
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const double narrow = static_cast<double>(ceil_div(jobs, grid * groups) * ceil_div(per_job, kMergeStep));
  const double wide = static_cast<double>(ceil_div(jobs, grid)) * (ceil_div(per_job, kMergeStep * groups) + 0.5);
  return wide < narrow;
}

}  // namespace fasttree::cuda_detail
