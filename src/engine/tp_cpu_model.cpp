#include "engine/tp_cpu_model.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>

#include "core/error.h"
#include "core/kv_tree.h"

namespace fasttree {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

TpCpuModel::TpCpuModel(const ModelWeights& weights, int32_t num_slots, TpCpuModelOptions options)
    : config_(weights.config), num_slots_(num_slots), options_(std::move(options)), planner_(options_.planner) {
  config_.validate();
  const int tp = options_.tp;
  check_tp(config_, tp);
  FT_CHECK(options_.threads_per_rank >= 0,
           "TpCpuModel: threads_per_rank must be >= 0, got " + str(options_.threads_per_rank));
  CpuModelOptions rank_options;
  rank_options.planner = options_.planner;
  rank_options.num_threads = options_.threads_per_rank;
  if (rank_options.num_threads == 0)
    rank_options.num_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / tp);
  group_ = std::make_unique<LocalGroup>(tp, options_.collective_timeout);
  reduce_index_.assign(static_cast<size_t>(tp), 0);
  rank_errors_.assign(static_cast<size_t>(tp), "");
  for (int r = 0; r < tp; ++r) {
    shards_.push_back(tp_shard(config_, r, tp));
    ranks_.push_back(std::make_unique<CpuModel>(shard_weights(weights, r, tp), num_slots, rank_options));
    ranks_.back()->set_row_parallel_hook([this, r](std::span<float> y) {
      int64_t& index = reduce_index_[static_cast<size_t>(r)];
      if (options_.before_all_reduce) options_.before_all_reduce(r, index);
      ++index;
      group_->comm(r).all_reduce_sum(y);
    });
  }
}

TpCpuModel::~TpCpuModel() = default;

const TpShard& TpCpuModel::shard(int rank) const {
  FT_CHECK(rank >= 0 && rank < tp(), "TpCpuModel: no rank " + str(rank) + " (tp " + str(tp()) + ")");
  return shards_[static_cast<size_t>(rank)];
}

const CpuModel& TpCpuModel::rank_model(int rank) const {
  FT_CHECK(rank >= 0 && rank < tp(), "TpCpuModel: no rank " + str(rank) + " (tp " + str(tp()) + ")");
  return *ranks_[static_cast<size_t>(rank)];
}

std::vector<float> TpCpuModel::run_ranks(const std::function<std::vector<float>(int rank)>& fn) {
  const int n = tp();
  std::fill(reduce_index_.begin(), reduce_index_.end(), 0);
  std::fill(rank_errors_.begin(), rank_errors_.end(), "");
  std::vector<std::vector<float>> out(static_cast<size_t>(n));
  std::vector<uint8_t> failed(static_cast<size_t>(n), 0);
  auto body = [&](int r) {
    std::string msg;
    try {
      out[static_cast<size_t>(r)] = fn(r);
      return;
    } catch (const Error& e) {
      msg = e.message();
    } catch (const std::exception& e) {
      msg = e.what();
    } catch (...) {
      msg = "unknown exception";
    }
    failed[static_cast<size_t>(r)] = 1;
    rank_errors_[static_cast<size_t>(r)] = msg;
    group_->abort(r, msg);  // wakes every rank waiting in a collective
  };
  {
    std::vector<std::jthread> threads;
    threads.reserve(static_cast<size_t>(n - 1));
    for (int r = 1; r < n; ++r) threads.emplace_back(body, r);
    body(0);
  }  // joined
  if (std::find(failed.begin(), failed.end(), 1) != failed.end()) {
    const std::string reason = group_->abort_reason();
    int stopped = 0;
    for (uint8_t f : failed) stopped += f;
    group_->reset();
    FT_FAIL("tensor-parallel step failed on " + reason + " (" + str(stopped) + " of " + str(n) +
            " ranks stopped with an error)");
  }
  // Replicated LM head over all-reduced activations: every rank must hold the same bits.
  for (int r = 1; r < n; ++r) {
    const std::vector<float>& a = out[0];
    const std::vector<float>& b = out[static_cast<size_t>(r)];
    FT_CHECK(a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0),
             "tensor-parallel ranks 0 and " + str(r) + " computed different logits (replicas diverged)");
  }
  return std::move(out[0]);
}

std::vector<float> TpCpuModel::prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                                       std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                                       bool all_logits) {
  return run_ranks([&](int r) {
    return ranks_[static_cast<size_t>(r)]->prefill(tokens, positions, slots, context_slots, all_logits);
  });
}

std::vector<float> TpCpuModel::decode(const DecodeBatch& batch, DecodeAttention attention) {
  FT_CHECK(batch.tree != nullptr, "decode: batch has no tree");
  DecodeBatch rank_batch = batch;
  rank_batch.plan = nullptr;
  if (attention == DecodeAttention::kFastTree && batch.tree->num_queries() > 0 &&
      batch.tree->num_queries() == static_cast<int64_t>(batch.tokens.size())) {
    // One plan for every rank, with the rank-local head counts (the same on every rank).
    const ModelConfig& local = ranks_[0]->config();
    if (batch.plan == nullptr) {
      validate_tree(*batch.tree, num_slots_);  // the planner's precondition
      planner_.build(*batch.tree, local.attn_shape(), plan_);
    } else {
      const Plan& p = *batch.plan;
      const bool global = p.num_qo_heads == config_.num_attention_heads && p.num_kv_heads == config_.num_key_value_heads;
      const bool rank_local =
          p.num_qo_heads == local.num_attention_heads && p.num_kv_heads == local.num_key_value_heads;
      FT_CHECK(global || rank_local, "decode: the batch's plan was built for " + str(p.num_qo_heads) + "/" +
                                         str(p.num_kv_heads) + " qo/kv heads, the model has " +
                                         str(config_.num_attention_heads) + "/" + str(config_.num_key_value_heads) +
                                         " (" + str(local.num_attention_heads) + "/" +
                                         str(local.num_key_value_heads) + " per rank)");
      plan_ = p;  // reuses plan_'s buffers: no allocation in steady state
      plan_.num_qo_heads = local.num_attention_heads;
      plan_.num_kv_heads = local.num_key_value_heads;
    }
    rank_batch.plan = &plan_;
  }
  return run_ranks([&](int r) { return ranks_[static_cast<size_t>(r)]->decode(rank_batch, attention); });
}

}  // namespace fasttree
