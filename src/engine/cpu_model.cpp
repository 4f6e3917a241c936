#include "engine/cpu_model.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "core/error.h"
#include "cpu/reference.h"
#include "engine/cpu_ops.h"
#include "plan/plan_validate.h"

namespace fasttree {

namespace {

std::string sz(size_t n) { return std::to_string(n); }

}  // namespace

CpuModel::CpuModel(ModelWeights weights, int32_t num_slots, CpuModelOptions options)
    : weights_(std::move(weights)),
      num_slots_(num_slots),
      options_(options),
      rope_(weights_.config),
      planner_(options.planner) {
  const ModelConfig& c = weights_.config;
  c.validate();
  FT_CHECK(num_slots > 0, "CpuModel: num_slots must be positive, got " + std::to_string(num_slots));
  FT_CHECK(weights_.layers.size() == static_cast<size_t>(c.num_hidden_layers),
           "CpuModel: weights hold " + sz(weights_.layers.size()) + " layers, the config " +
               std::to_string(c.num_hidden_layers));
  // Every tensor must have its config size (weights built by hand could be inconsistent).
  for (const WeightTensor& t : weight_tensors(weights_)) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    FT_CHECK(t.data->size() == static_cast<size_t>(numel),
             "CpuModel: weight '" + t.name + "' holds " + sz(t.data->size()) + " floats, expected " +
                 shape_str(t.shape));
  }
  const size_t pool = static_cast<size_t>(num_slots) * static_cast<size_t>(c.kv_dim());
  const double pool_bytes = 2.0 * 4.0 * static_cast<double>(pool) * c.num_hidden_layers;
  FT_CHECK(pool_bytes <= kMaxCpuKvBytes, "CpuModel: a KV pool of " + std::to_string(num_slots) + " slots needs " +
                                             std::to_string(pool_bytes / (1 << 30)) + " GiB (limit " +
                                             std::to_string(kMaxCpuKvBytes / (1 << 30)) + " GiB)");
  k_.assign(static_cast<size_t>(c.num_hidden_layers), std::vector<float>(pool, 0.0f));
  v_.assign(static_cast<size_t>(c.num_hidden_layers), std::vector<float>(pool, 0.0f));
}

std::span<const float> CpuModel::k_cache(int layer) const {
  FT_CHECK(layer >= 0 && layer < config().num_hidden_layers, "k_cache: no layer " + std::to_string(layer));
  return k_[static_cast<size_t>(layer)];
}

std::span<const float> CpuModel::v_cache(int layer) const {
  FT_CHECK(layer >= 0 && layer < config().num_hidden_layers, "v_cache: no layer " + std::to_string(layer));
  return v_[static_cast<size_t>(layer)];
}

void CpuModel::check_tokens(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                            std::span<const int32_t> slots, const char* what) const {
  const std::string w(what);
  FT_CHECK(positions.size() == tokens.size(), w + ": " + sz(tokens.size()) + " tokens but " +
                                                  sz(positions.size()) + " positions");
  FT_CHECK(slots.size() == tokens.size(), w + ": " + sz(tokens.size()) + " tokens but " + sz(slots.size()) + " slots");
  for (size_t i = 0; i < tokens.size(); ++i) {
    FT_CHECK(tokens[i] >= 0 && tokens[i] < config().vocab_size,
             w + ": token " + std::to_string(tokens[i]) + " (row " + sz(i) + ") outside the vocabulary [0, " +
                 std::to_string(config().vocab_size) + ")");
    FT_CHECK(positions[i] >= 0, w + ": negative position " + std::to_string(positions[i]) + " (row " + sz(i) + ")");
    FT_CHECK(slots[i] >= 0 && slots[i] < num_slots_, w + ": slot " + std::to_string(slots[i]) + " (row " + sz(i) +
                                                         ") out of range [0, " + std::to_string(num_slots_) + ")");
  }
  std::vector<int32_t> sorted(slots.begin(), slots.end());
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  FT_CHECK(dup == sorted.end(), w + ": slot " + (dup == sorted.end() ? "" : std::to_string(*dup)) +
                                    " is written by two tokens");
}

std::vector<float> CpuModel::forward(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                                     std::span<const int32_t> slots, const AttendFn& attend,
                                     int64_t first_logit_row) {
  const ModelConfig& c = config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t h = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), inter = c.intermediate_size;
  const int threads = options_.num_threads;
  const float eps = static_cast<float>(c.rms_norm_eps);

  std::vector<float> x(static_cast<size_t>(n * h));
  for (int64_t i = 0; i < n; ++i)
    std::copy_n(weights_.embed.data() + static_cast<int64_t>(tokens[i]) * h, h, x.data() + i * h);
  std::vector<float> xn(x.size()), q(static_cast<size_t>(n * qd)), k(static_cast<size_t>(n * kvd)),
      v(static_cast<size_t>(n * kvd)), attn(static_cast<size_t>(n * qd)), proj(x.size()),
      gate(static_cast<size_t>(n * inter)), up(static_cast<size_t>(n * inter));

  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const LayerWeights& lw = weights_.layers[static_cast<size_t>(l)];
    rms_norm(x, lw.input_norm, eps, xn);
    linear(xn, n, lw.wq, qd, h, lw.bq, q, threads);
    linear(xn, n, lw.wk, kvd, h, lw.bk, k, threads);
    linear(xn, n, lw.wv, kvd, h, lw.bv, v, threads);
    float* kpool = k_[static_cast<size_t>(l)].data();
    float* vpool = v_[static_cast<size_t>(l)].data();
    for (int64_t i = 0; i < n; ++i) {
      rope_.apply({q.data() + i * qd, static_cast<size_t>(qd)}, c.num_attention_heads, positions[i]);
      rope_.apply({k.data() + i * kvd, static_cast<size_t>(kvd)}, c.num_key_value_heads, positions[i]);
      std::copy_n(k.data() + i * kvd, kvd, kpool + static_cast<int64_t>(slots[i]) * kvd);
      std::copy_n(v.data() + i * kvd, kvd, vpool + static_cast<int64_t>(slots[i]) * kvd);
    }
    attend(l, q, attn);
    linear(attn, n, lw.wo, h, qd, lw.bo, proj, threads);
    if (row_parallel_hook_) row_parallel_hook_(proj);
    add_inplace(x, proj);
    rms_norm(x, lw.post_norm, eps, xn);
    linear(xn, n, lw.w_gate, inter, h, {}, gate, threads);
    linear(xn, n, lw.w_up, inter, h, {}, up, threads);
    silu_mul(gate, up);
    linear(gate, n, lw.w_down, h, inter, {}, proj, threads);
    if (row_parallel_hook_) row_parallel_hook_(proj);
    add_inplace(x, proj);
  }
  const int64_t rows = n - first_logit_row;
  std::span<const float> last(x.data() + first_logit_row * h, static_cast<size_t>(rows * h));
  std::vector<float> normed(last.size());
  rms_norm(last, weights_.final_norm, eps, normed);
  std::vector<float> logits(static_cast<size_t>(rows * c.vocab_size));
  linear(normed, rows, weights_.output_weight(), c.vocab_size, h, {}, logits, threads);
  return logits;
}

std::vector<float> CpuModel::prefill(std::span<const int32_t> tokens, std::span<const int32_t> positions,
                                     std::span<const int32_t> slots, std::span<const int32_t> context_slots,
                                     bool all_logits) {
  FT_CHECK(!tokens.empty(), "prefill: no tokens");
  check_tokens(tokens, positions, slots, "prefill");
  const ModelConfig& c = config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t total = static_cast<int64_t>(context_slots.size()) + n;
  FT_CHECK(c.sliding_window == 0 || total <= c.sliding_window,
           "prefill: context of " + std::to_string(total) + " tokens exceeds the sliding window of " +
               std::to_string(c.sliding_window) + " (not supported)");
  // Causal attention as a chain tree: root = cached context, node i+1 = new token i, query i at node i+1.
  KvTree tree;
  int node = tree.add_node(-1, context_slots);
  for (int64_t i = 0; i < n; ++i) {
    node = tree.add_node(node, slots.subspan(static_cast<size_t>(i), 1));
    tree.add_query(node);
  }
  validate_tree(tree, num_slots_);  // context slots in range, no slot twice (context vs new tokens)
  const AttnShape shape = c.attn_shape();
  const float scale = shape.default_sm_scale();
  auto attend = [&](int layer, std::span<const float> q, std::span<float> out) {
    reference_attention(tree, shape, q, k_[static_cast<size_t>(layer)], v_[static_cast<size_t>(layer)], scale, out,
                        {}, options_.num_threads);
  };
  return forward(tokens, positions, slots, attend, all_logits ? 0 : n - 1);
}

std::vector<float> CpuModel::decode(const DecodeBatch& batch, DecodeAttention attention) {
  FT_CHECK(batch.tree != nullptr, "decode: batch has no tree");
  check_tokens(batch.tokens, batch.positions, batch.slots, "decode");
  const int64_t b = check_decode_tree(batch, config(), num_slots_);
  if (b == 0) return {};
  const KvTree& tree = *batch.tree;
  const ModelConfig& c = config();
  const AttnShape shape = c.attn_shape();
  const float scale = shape.default_sm_scale();
  if (attention == DecodeAttention::kFastTree) {
    const Plan* plan = batch.plan;
    if (plan == nullptr) {
      planner_.build(tree, shape, plan_);
      plan = &plan_;
    } else {
      validate_plan(*plan, tree);
    }
    auto attend = [&](int layer, std::span<const float> q, std::span<float> out) {
      execute_plan(*plan, tree, shape, q, k_[static_cast<size_t>(layer)], v_[static_cast<size_t>(layer)], scale, out,
                   {}, workspace_, options_.num_threads);
    };
    return forward(batch.tokens, batch.positions, batch.slots, attend, 0);
  }
  auto attend = [&](int layer, std::span<const float> q, std::span<float> out) {
    reference_attention(tree, shape, q, k_[static_cast<size_t>(layer)], v_[static_cast<size_t>(layer)], scale, out, {},
                        options_.num_threads);
  };
  return forward(batch.tokens, batch.positions, batch.slots, attend, 0);
}

}  // namespace fasttree
