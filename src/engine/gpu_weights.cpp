#include "engine/gpu_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>

#include "core/error.h"
#include "core/half.h"
#include "core/npy.h"
#include "cuda/engine_ops.h"
#include "engine/gpu_model.h"  // gpu_kernel_head_dim
#include "engine/tp_shard.h"

namespace fasttree {

namespace {

constexpr size_t kAlign = 256;
constexpr size_t kAbsent = std::numeric_limits<size_t>::max();

std::string num(int64_t v) { return std::to_string(v); }

// Byte offsets of every tensor inside the arena (kAbsent: the tensor does not exist).
struct LayerOffsets {
  size_t input_norm, w_qkv, b_qkv, w_o, b_o, post_norm, w_gate_up, w_down;
};
struct Offsets {
  size_t embed = 0, final_norm = 0, lm_head = 0, total = 0;
  std::vector<LayerOffsets> layers;
};

Offsets layout(const ModelConfig& c, int dk) {
  const size_t h = static_cast<size_t>(c.hidden_size), inter = static_cast<size_t>(c.intermediate_size);
  const size_t v = static_cast<size_t>(c.vocab_size);
  const size_t qkv_rows = static_cast<size_t>(c.num_attention_heads + 2 * c.num_key_value_heads) * dk;
  const size_t qd = static_cast<size_t>(c.num_attention_heads) * dk;
  Offsets o;
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = (off + kAlign - 1) / kAlign * kAlign;
    off = at + bytes;
    return at;
  };
  o.embed = take(v * h * 2);
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    LayerOffsets lo{};
    lo.input_norm = take(h * 2);
    lo.w_qkv = take(qkv_rows * h * 2);
    lo.b_qkv = c.attention_bias ? take(qkv_rows * 4) : kAbsent;
    lo.w_o = take(h * qd * 2);
    lo.b_o = c.o_proj_bias() ? take(h * 4) : kAbsent;
    lo.post_norm = take(h * 2);
    lo.w_gate_up = take(2 * inter * h * 2);
    lo.w_down = take(h * inter * 2);
    o.layers.push_back(lo);
  }
  o.final_norm = take(h * 2);
  o.lm_head = c.tie_word_embeddings ? o.embed : take(v * h * 2);
  o.total = off;
  return o;
}

// Source row / column of a padded destination row / column (gpu_weights.h).
struct HeadMap {
  int d, dk;
  int64_t to_src(int64_t dst) const {  // -1 for a padding index
    const int64_t head = dst / dk, j = dst % dk;
    if (j < d / 2) return head * d + j;
    if (j >= dk / 2 && j < dk / 2 + d / 2) return head * d + d / 2 + (j - dk / 2);
    return -1;
  }
};

enum class Remap { kNone, kRows, kCols };
enum class Init { kNorm, kBias, kEmbed, kProj };
// How tensor parallelism splits a tensor (engine/tp_shard.h): whole on every rank, a row block
// (column-parallel q / kv / gate / up weights and biases), a column block (row-parallel o_proj and
// down_proj), or whole on rank 0 and zero elsewhere (o_proj's bias, added before the all-reduce).
enum class Split { kReplicated, kQRows, kKvRows, kInterRows, kQCols, kInterCols, kRank0 };

// One checkpoint tensor and where it goes.
struct Target {
  std::string name;
  std::vector<int64_t> shape;  // source shape (HF)
  void* dst = nullptr;
  bool f32 = false;            // destination dtype: fp32 (biases) or bf16
  Remap remap = Remap::kNone;  // head padding of rows (q/k/v weights and biases) or columns (o_proj)
  Init init = Init::kProj;
  Split split = Split::kReplicated;
  int64_t src_rows() const { return shape[0]; }
  int64_t src_cols() const { return shape.size() == 2 ? shape[1] : 1; }
};

// The tensors of `c` in the layout of `w` (destinations nullptr when w is null: names and shapes only).
std::vector<Target> targets(const ModelConfig& c, int dk, GpuWeights* w) {
  const int d = c.head_dim;
  const bool pad = dk != d;
  const int64_t h = c.hidden_size, inter = c.intermediate_size, v = c.vocab_size;
  const int64_t hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  const Remap rows = pad ? Remap::kRows : Remap::kNone, cols = pad ? Remap::kCols : Remap::kNone;
  auto at = [](auto* p, int64_t off) { return p == nullptr ? p : p + off; };
  std::vector<Target> t;
  t.push_back({"model.embed_tokens.weight", {v, h}, w ? w->embed : nullptr, false, Remap::kNone, Init::kEmbed});
  for (int i = 0; i < c.num_hidden_layers; ++i) {
    const GpuLayerWeights l = w ? w->layers[static_cast<size_t>(i)] : GpuLayerWeights{};
    const std::string p = "model.layers." + num(i) + ".";
    const int64_t k_row = hq * dk, v_row = (hq + hkv) * dk;  // first padded row of k / v
    t.push_back({p + "input_layernorm.weight", {h}, l.input_norm, false, Remap::kNone, Init::kNorm});
    t.push_back({p + "self_attn.q_proj.weight", {qd, h}, l.w_qkv, false, rows, Init::kProj, Split::kQRows});
    if (c.attention_bias)
      t.push_back({p + "self_attn.q_proj.bias", {qd}, l.b_qkv, true, rows, Init::kBias, Split::kQRows});
    t.push_back({p + "self_attn.k_proj.weight", {kvd, h}, at(l.w_qkv, k_row * h), false, rows, Init::kProj,
                 Split::kKvRows});
    if (c.attention_bias)
      t.push_back({p + "self_attn.k_proj.bias", {kvd}, at(l.b_qkv, k_row), true, rows, Init::kBias, Split::kKvRows});
    t.push_back({p + "self_attn.v_proj.weight", {kvd, h}, at(l.w_qkv, v_row * h), false, rows, Init::kProj,
                 Split::kKvRows});
    if (c.attention_bias)
      t.push_back({p + "self_attn.v_proj.bias", {kvd}, at(l.b_qkv, v_row), true, rows, Init::kBias, Split::kKvRows});
    t.push_back({p + "self_attn.o_proj.weight", {h, qd}, l.w_o, false, cols, Init::kProj, Split::kQCols});
    if (c.o_proj_bias())
      t.push_back({p + "self_attn.o_proj.bias", {h}, l.b_o, true, Remap::kNone, Init::kBias, Split::kRank0});
    t.push_back({p + "post_attention_layernorm.weight", {h}, l.post_norm, false, Remap::kNone, Init::kNorm});
    t.push_back({p + "mlp.gate_proj.weight", {inter, h}, l.w_gate_up, false, Remap::kNone, Init::kProj,
                 Split::kInterRows});
    t.push_back({p + "mlp.up_proj.weight", {inter, h}, at(l.w_gate_up, inter * h), false, Remap::kNone, Init::kProj,
                 Split::kInterRows});
    t.push_back({p + "mlp.down_proj.weight", {h, inter}, l.w_down, false, Remap::kNone, Init::kProj,
                 Split::kInterCols});
  }
  t.push_back({"model.norm.weight", {h}, w ? w->final_norm : nullptr, false, Remap::kNone, Init::kNorm});
  if (!c.tie_word_embeddings)
    t.push_back({"lm_head.weight", {v, h}, w ? w->lm_head : nullptr, false, Remap::kNone, Init::kProj});
  return t;
}

std::vector<Target> targets(GpuWeights& w) { return targets(w.config(), w.kernel_head_dim(), &w); }

// Source elements [first, first + n) of dtype `dtype` at `base` (any alignment) -> dst (fp32 or bf16).
void convert(DType dtype, const void* base, int64_t first, int64_t n, void* dst, bool dst_f32) {
  const auto* src = static_cast<const unsigned char*>(base) + static_cast<size_t>(first) * dtype_size(dtype);
  if (dst_f32) {
    convert_to_f32(dtype, src, n, static_cast<float*>(dst));
    return;
  }
  if (dtype == DType::kBF16) {
    std::memcpy(dst, src, static_cast<size_t>(n) * 2);
    return;
  }
  thread_local std::vector<float> tmp;
  tmp.resize(static_cast<size_t>(n));
  convert_to_f32(dtype, src, n, tmp.data());
  auto* out = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(tmp[static_cast<size_t>(i)]);
}

// Uploads one target from host data of `dtype` laid out as t.shape with rows `pitch` elements apart
// (< 0: t.shape's own column count, i.e. contiguous), applying the head padding.
void upload_target(const Target& t, DType dtype, const void* src, const HeadMap& map, UploadStager& stager,
                   int64_t pitch = -1) {
  const size_t esize = t.f32 ? 4 : 2;
  const int64_t src_cols = t.src_cols();
  if (pitch < 0) pitch = src_cols;
  const int64_t dst_rows = t.remap == Remap::kRows ? t.src_rows() / map.d * map.dk : t.src_rows();
  const int64_t dst_cols = t.remap == Remap::kCols ? src_cols / map.d * map.dk : src_cols;
  UploadStager::Fill fill;
  if (t.remap == Remap::kNone && pitch == src_cols) {
    fill = [&](void* host, int64_t first, int64_t count) { convert(dtype, src, first, count, host, t.f32); };
  } else {
    fill = [&](void* host, int64_t first, int64_t count) {
      auto* out = static_cast<unsigned char*>(host);
      std::vector<unsigned char> row(static_cast<size_t>(src_cols) * esize);
      for (int64_t r = first / dst_cols; r < (first + count) / dst_cols; ++r, out += dst_cols * esize) {
        const int64_t sr = t.remap == Remap::kRows ? map.to_src(r) : r;
        if (sr < 0) {
          std::memset(out, 0, static_cast<size_t>(dst_cols) * esize);
          continue;
        }
        if (t.remap != Remap::kCols) {
          convert(dtype, src, sr * pitch, src_cols, out, t.f32);
          continue;
        }
        convert(dtype, src, sr * pitch, src_cols, row.data(), t.f32);
        for (int64_t c = 0; c < dst_cols; ++c) {
          const int64_t sc = map.to_src(c);
          if (sc < 0)
            std::memset(out + c * esize, 0, esize);
          else
            std::memcpy(out + c * esize, row.data() + sc * esize, esize);
        }
      }
    };
  }
  stager.upload(t.dst, dst_rows * dst_cols, esize, dst_cols, fill);
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

size_t gpu_weight_bytes(const ModelConfig& config) {
  config.validate();
  return layout(config, gpu_kernel_head_dim(config.head_dim)).total;
}

GpuWeights::GpuWeights(const ModelConfig& config) : config_(config) {
  config_.validate();
  dk_ = gpu_kernel_head_dim(config_.head_dim);
  const Offsets o = layout(config_, dk_);
  arena_.reserve(o.total);
  auto* base = static_cast<unsigned char*>(arena_.data());
  auto bf = [&](size_t off) { return off == kAbsent ? nullptr : reinterpret_cast<uint16_t*>(base + off); };
  auto f32 = [&](size_t off) { return off == kAbsent ? nullptr : reinterpret_cast<float*>(base + off); };
  embed = bf(o.embed);
  final_norm = bf(o.final_norm);
  lm_head = bf(o.lm_head);
  for (const LayerOffsets& lo : o.layers)
    layers.push_back({bf(lo.input_norm), bf(lo.w_qkv), f32(lo.b_qkv), bf(lo.w_o), f32(lo.b_o), bf(lo.post_norm),
                      bf(lo.w_gate_up), bf(lo.w_down)});
}

GpuWeights upload_gpu_weights(const ModelWeights& weights, CUstream_st* stream) {
  GpuWeights w(weights.config);
  const HeadMap map{weights.config.head_dim, w.kernel_head_dim()};
  // Host tensors by HF name (weight_tensors only reads through the pointers here).
  std::map<std::string, const std::vector<float>*> host;
  for (const WeightTensor& t : weight_tensors(const_cast<ModelWeights&>(weights))) host[t.name] = t.data;
  UploadStager stager(stream);
  for (const Target& t : targets(w)) {
    const std::vector<float>* data = host.at(t.name);
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    FT_CHECK(data->size() == static_cast<size_t>(numel), "GPU model: weight '" + t.name + "' holds " +
                                                             num(static_cast<int64_t>(data->size())) +
                                                             " floats, expected " + shape_str(t.shape));
    upload_target(t, DType::kF32, data->data(), map, stager);
  }
  stager.finish();
  return w;
}

GpuWeights load_gpu_weights(const SafetensorsFolder& folder, const ModelConfig& config, CUstream_st* stream) {
  return load_gpu_weights_shard(folder, config, 0, 1, stream);
}

GpuWeights load_gpu_weights_shard(const SafetensorsFolder& folder, const ModelConfig& config, int rank, int tp,
                                  CUstream_st* stream) {
  config.validate();
  const TpShard shard = tp_shard(config, rank, tp);  // checks tp and rank
  check_checkpoint(folder, config);                  // before allocating device memory
  GpuWeights w(tp == 1 ? config : tp_local_config(config, tp));
  const HeadMap map{config.head_dim, w.kernel_head_dim()};
  // The whole model's tensor list (names, shapes) and this rank's destinations, in the same order.
  const std::vector<Target> full = targets(config, w.kernel_head_dim(), nullptr);
  const std::vector<Target> local = targets(w);
  FT_CHECK(full.size() == local.size(), "load_gpu_weights_shard: tensor lists differ");
  UploadStager stager(stream);
  std::vector<float> zeros;
  for (size_t i = 0; i < full.size(); ++i) {
    const Target& t = local[i];
    const TensorView& v = folder.tensor(full[i].name);
    const TpBlock b = tp_block(shard, full[i].name, v.shape);
    FT_CHECK(b.rows == t.src_rows() && b.cols == t.src_cols(), "load_gpu_weights_shard: block of '" + full[i].name +
                                                                   "' does not match the rank's tensor " + shape_str(t.shape));
    if (b.zeros) {
      zeros.assign(static_cast<size_t>(b.rows * b.cols), 0.0f);
      upload_target(t, DType::kF32, zeros.data(), map, stager);
      continue;
    }
    // Only the rank's block is read from the mapping: a row block is contiguous, a column block
    // keeps the whole tensor's row pitch.
    const int64_t pitch = full[i].src_cols();
    const auto* src = static_cast<const unsigned char*>(v.data) +
                      static_cast<size_t>(b.row_begin * pitch + b.col_begin) * dtype_size(v.dtype);
    upload_target(t, v.dtype, src, map, stager, pitch);
  }
  stager.finish();
  return w;
}

GpuWeights random_gpu_weights(const ModelConfig& config, uint64_t seed, CUstream_st* stream) {
  return random_gpu_weights_shard(config, seed, 0, 1, stream);
}

GpuWeights random_gpu_weights_shard(const ModelConfig& config, uint64_t seed, int rank, int tp, CUstream_st* stream) {
  config.validate();
  const TpShard shard = tp_shard(config, rank, tp);  // checks tp and rank
  if (config.num_params() <= kGpuHostRandomMaxParams) {
    if (tp == 1) return upload_gpu_weights(random_weights(config, seed), stream);
    return upload_gpu_weights(shard_weights(random_weights(config, seed), rank, tp), stream);
  }
  GpuWeights w(tp == 1 ? config : tp_local_config(config, tp));
  const int d = config.head_dim, dk = w.kernel_head_dim();
  const HeadMap map{d, dk};
  // The whole model's tensors (seeds, shapes, distributions) and this rank's destinations, in the
  // same order: every tensor is generated whole, exactly as for tp 1, and the rank keeps its block.
  const std::vector<Target> full = targets(config, dk, nullptr);
  const std::vector<Target> local = targets(w);
  FT_CHECK(full.size() == local.size(), "random_gpu_weights_shard: tensor lists differ");
  UploadStager stager(stream);
  DeviceBuffer scratch;  // one whole bf16 tensor of a split weight, sized once for the largest
  if (tp > 1) {
    size_t most = 0;
    for (const Target& f : full) {
      if (f.f32 || f.split == Split::kReplicated || f.split == Split::kRank0) continue;
      const int64_t rows = f.remap == Remap::kRows ? f.src_rows() / d * dk : f.src_rows();
      const int64_t cols = f.remap == Remap::kCols ? f.src_cols() / d * dk : f.src_cols();
      most = std::max(most, static_cast<size_t>(rows * cols) * 2);
    }
    scratch.reserve(most);
  }
  std::vector<float> bias;
  for (size_t i = 0; i < full.size(); ++i) {
    const Target& f = full[i];
    const Target& t = local[i];
    const uint64_t tseed = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(i) + 1));
    // This rank's block of source rows (row splits) or columns (column splits).
    int64_t begin = 0, count = 0;
    switch (f.split) {
      case Split::kQRows: case Split::kQCols: begin = shard.q_row_begin(), count = shard.q_rows(); break;
      case Split::kKvRows: begin = shard.kv_row_begin(), count = shard.kv_rows(); break;
      case Split::kInterRows: case Split::kInterCols: begin = shard.inter_begin, count = shard.inter_size; break;
      default: break;
    }
    const bool whole = tp == 1 || f.split == Split::kReplicated;
    if (f.init == Init::kBias) {  // fp32, small: on the host
      std::mt19937_64 rng(tseed);
      bias.resize(static_cast<size_t>(f.src_rows()));
      for (float& b : bias) b = -0.1f + 0.2f * (static_cast<float>(rng() >> 40) * (1.0f / 16777216.0f));
      if (!whole && f.split == Split::kRank0 && rank != 0) std::fill(bias.begin(), bias.end(), 0.0f);
      const float* src = bias.data() + ((whole || f.split == Split::kRank0) ? 0 : begin);
      upload_target(t, DType::kF32, src, map, stager);
      continue;
    }
    float lo = -1.0f, hi = 1.0f;
    if (f.init == Init::kNorm) {
      lo = 0.9f, hi = 1.1f;
    } else if (f.init == Init::kProj) {
      hi = static_cast<float>(std::sqrt(3.0 / static_cast<double>(f.src_cols())));  // the whole tensor's fan-in
      lo = -hi;
    }
    const int64_t src_cols = f.src_cols();
    const int64_t dst_rows = f.remap == Remap::kRows ? f.src_rows() / d * dk : f.src_rows();
    const int64_t dst_cols = f.remap == Remap::kCols ? src_cols / d * dk : src_cols;
    uint16_t* dst = static_cast<uint16_t*>(t.dst);
    if (!whole) dst = scratch.as<uint16_t>();  // stream-ordered reuse: the previous copy-out runs first
    cuda_ops::fill_uniform_bf16(dst, dst_rows * dst_cols, lo, hi, tseed, stream);
    // Zero the head padding (gpu_weights.h): rows [d/2, dk/2) and [dk/2 + d/2, dk) of each head.
    const int64_t gap = dk / 2 - d / 2;
    if (f.remap == Remap::kRows && gap > 0) {
      for (int64_t head = 0; head < f.src_rows() / d; ++head)
        for (int64_t start : {head * dk + d / 2, head * dk + dk / 2 + d / 2})
          memset_device(dst + start * dst_cols, 0, static_cast<size_t>(gap * dst_cols) * 2, stream);
    } else if (f.remap == Remap::kCols && gap > 0) {
      for (int64_t head = 0; head < src_cols / d; ++head)
        for (int64_t start : {head * dk + d / 2, head * dk + dk / 2 + d / 2})
          memset_device_2d(dst + start, static_cast<size_t>(dst_cols) * 2, 0, static_cast<size_t>(gap) * 2,
                           static_cast<size_t>(dst_rows), stream);
    }
    if (whole) continue;
    // Head blocks start at multiples of d (source) = multiples of dk (padded).
    const bool head_units = f.split == Split::kQRows || f.split == Split::kKvRows || f.split == Split::kQCols;
    const int64_t pb = head_units && f.remap != Remap::kNone ? begin / d * dk : begin;
    const int64_t pc = head_units && f.remap != Remap::kNone ? count / d * dk : count;
    if (f.split == Split::kQCols || f.split == Split::kInterCols) {
      copy_on_device_2d(t.dst, static_cast<size_t>(pc) * 2, dst + pb, static_cast<size_t>(dst_cols) * 2,
                        static_cast<size_t>(pc) * 2, static_cast<size_t>(dst_rows), stream);
    } else {
      copy_on_device(t.dst, dst + pb * dst_cols, static_cast<size_t>(pc * dst_cols) * 2, stream);
    }
  }
  stager.finish();
  synchronize(stream);
  return w;
}

}  // namespace fasttree
