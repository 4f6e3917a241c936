// Tensor parallelism on the CPU (issue 5's CI part): the sharding math (engine/tp_shard.h), the
// CPU stand-in for the all-reduce (engine/all_reduce.h LocalGroup: sums, timeouts, aborts), and
// TpCpuModel against the unsharded CpuModel on the golden tiny checkpoints (tp 1, 2, 4: logits
// within 1e-4 * max(1, |x|) element-wise, identical greedy tokens, also through the Scheduler).
// The NCCL wrapper (cuda/nccl_comm.h) only for its argument checks and its clear errors here.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cuda/backend.h"
#include "cuda/nccl_comm.h"
#include "engine/all_reduce.h"
#include "engine/cpu_model.h"
#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "engine/slot_paths.h"
#include "engine/tp_cpu_model.h"
#include "engine/tp_shard.h"
#include "engine/weights.h"
#include "golden_util.h"
#include "engine_test_util.h"

namespace fasttree {
namespace {

using test::expect_error;
using Clock = std::chrono::steady_clock;

double elapsed_ms(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

ModelConfig shape(int hq, int hkv, int64_t inter, bool bias = false) {
  ModelConfig c = model_preset("tiny");
  c.num_attention_heads = hq;
  c.num_key_value_heads = hkv;
  c.intermediate_size = inter;
  c.attention_bias = bias;
  return c;
}

// ---- sharding math ---------------------------------------------------------------------------

TEST(TpShard, EveryHeadAndColumnOwnedExactlyOnce) {
  struct Case {
    int hq, hkv;
    int64_t inter;
    std::vector<int> tps;
  };
  const std::vector<Case> cases = {
      {4, 4, 128, {1, 2, 4}}, {4, 2, 128, {1, 2, 4}}, {4, 1, 128, {1, 2, 4}}, {32, 8, 11008, {1, 2, 4, 8}},
      {64, 8, 28672, {1, 2, 4, 8, 16}}, {12, 4, 96, {1, 2, 4, 12}},
  };
  for (const Case& k : cases) {
    const ModelConfig c = shape(k.hq, k.hkv, k.inter);
    const int g = k.hq / k.hkv;
    for (int tp : k.tps) {
      SCOPED_TRACE("Hq " + std::to_string(k.hq) + " Hkv " + std::to_string(k.hkv) + " tp " + std::to_string(tp));
      std::vector<int> q_owner(static_cast<size_t>(k.hq), 0), kv_holders(static_cast<size_t>(k.hkv), 0);
      std::vector<int> col_owner(static_cast<size_t>(k.inter), 0);
      const ModelConfig local = tp_local_config(c, tp);
      for (int r = 0; r < tp; ++r) {
        const TpShard s = tp_shard(c, r, tp);
        EXPECT_EQ(s.num_q_heads, k.hq / tp);
        EXPECT_EQ(s.num_q_heads, local.num_attention_heads);
        EXPECT_EQ(s.num_kv_heads, local.num_key_value_heads);
        EXPECT_EQ(s.inter_size, local.intermediate_size);
        EXPECT_EQ(s.q_row_begin(), int64_t{s.q_head_begin} * c.head_dim);
        EXPECT_EQ(s.kv_rows(), int64_t{s.num_kv_heads} * c.head_dim);
        for (int h = s.q_head_begin; h < s.q_head_begin + s.num_q_heads; ++h) {
          ++q_owner[static_cast<size_t>(h)];
          // GQA: the head's global kv head is held by the rank, at the local index the local GQA
          // ratio maps it to.
          const int kv = h / g;
          ASSERT_GE(kv, s.kv_head_begin);
          ASSERT_LT(kv, s.kv_head_begin + s.num_kv_heads);
          const int local_g = s.num_q_heads / s.num_kv_heads;
          EXPECT_EQ((h - s.q_head_begin) / local_g, kv - s.kv_head_begin);
        }
        for (int h = s.kv_head_begin; h < s.kv_head_begin + s.num_kv_heads; ++h) ++kv_holders[static_cast<size_t>(h)];
        for (int64_t i = s.inter_begin; i < s.inter_begin + s.inter_size; ++i) ++col_owner[static_cast<size_t>(i)];
      }
      for (int v : q_owner) EXPECT_EQ(v, 1);
      for (int v : col_owner) EXPECT_EQ(v, 1);
      const int replicas = tp > k.hkv ? tp / k.hkv : 1;
      for (int v : kv_holders) EXPECT_EQ(v, replicas);
      EXPECT_EQ(tp_shard(c, 0, tp).kv_replicas, replicas);
      EXPECT_EQ(local.hidden_size, c.hidden_size);
      EXPECT_EQ(local.vocab_size, c.vocab_size);
    }
  }
}

// Concatenating the ranks' slices gives back the whole tensors.
TEST(TpShard, ShardWeightsReassemble) {
  for (int hkv : {4, 2, 1}) {
    ModelConfig c = shape(4, hkv, 128, true);  // llama with attention_bias: o_proj has a bias too
    ASSERT_TRUE(c.o_proj_bias());
    const ModelWeights w = random_weights(c, 7);
    const int64_t h = c.hidden_size, inter = c.intermediate_size;
    for (int tp : {1, 2, 4}) {
      SCOPED_TRACE("Hkv " + std::to_string(hkv) + " tp " + std::to_string(tp));
      std::vector<ModelWeights> shards;
      for (int r = 0; r < tp; ++r) shards.push_back(shard_weights(w, r, tp));
      for (size_t l = 0; l < w.layers.size(); ++l) {
        const LayerWeights& full = w.layers[l];
        std::vector<float> wq, bq, wg, wu;
        std::vector<float> wo(static_cast<size_t>(h * c.q_dim())), wd(static_cast<size_t>(h * inter));
        std::vector<float> bo_sum(static_cast<size_t>(h), 0.0f);
        for (int r = 0; r < tp; ++r) {
          const LayerWeights& s = shards[static_cast<size_t>(r)].layers[l];
          const TpShard sh = tp_shard(c, r, tp);
          wq.insert(wq.end(), s.wq.begin(), s.wq.end());
          bq.insert(bq.end(), s.bq.begin(), s.bq.end());
          wg.insert(wg.end(), s.w_gate.begin(), s.w_gate.end());
          wu.insert(wu.end(), s.w_up.begin(), s.w_up.end());
          // k/v: the rank's kv heads' rows (replicated heads appear on several ranks).
          const std::vector<float> wk(full.wk.begin() + sh.kv_row_begin() * h,
                                      full.wk.begin() + (sh.kv_row_begin() + sh.kv_rows()) * h);
          EXPECT_EQ(s.wk, wk);
          const std::vector<float> bv(full.bv.begin() + sh.kv_row_begin(),
                                      full.bv.begin() + sh.kv_row_begin() + sh.kv_rows());
          EXPECT_EQ(s.bv, bv);
          ASSERT_EQ(s.wo.size(), static_cast<size_t>(h * sh.q_rows()));
          for (int64_t row = 0; row < h; ++row)
            for (int64_t j = 0; j < sh.q_rows(); ++j)
              wo[static_cast<size_t>(row * c.q_dim() + sh.q_row_begin() + j)] = s.wo[static_cast<size_t>(row * sh.q_rows() + j)];
          for (int64_t row = 0; row < h; ++row)
            for (int64_t j = 0; j < sh.inter_size; ++j)
              wd[static_cast<size_t>(row * inter + sh.inter_begin + j)] = s.w_down[static_cast<size_t>(row * sh.inter_size + j)];
          ASSERT_EQ(s.bo.size(), static_cast<size_t>(h));
          if (r > 0) EXPECT_TRUE(std::all_of(s.bo.begin(), s.bo.end(), [](float x) { return x == 0.0f; }));
          for (int64_t i = 0; i < h; ++i) bo_sum[static_cast<size_t>(i)] += s.bo[static_cast<size_t>(i)];
          EXPECT_EQ(s.input_norm, full.input_norm);
          EXPECT_EQ(s.post_norm, full.post_norm);
        }
        EXPECT_EQ(wq, full.wq);
        EXPECT_EQ(bq, full.bq);
        EXPECT_EQ(wg, full.w_gate);
        EXPECT_EQ(wu, full.w_up);
        EXPECT_EQ(wo, full.wo);
        EXPECT_EQ(wd, full.w_down);
        EXPECT_EQ(bo_sum, full.bo);  // counted exactly once
      }
      for (const ModelWeights& s : shards) {
        EXPECT_EQ(s.embed, w.embed);
        EXPECT_EQ(s.lm_head, w.lm_head);
        EXPECT_EQ(s.final_norm, w.final_norm);
        EXPECT_EQ(s.config, tp_local_config(c, tp));
      }
    }
  }
}

// tp_block (what a checkpoint loader reads for a rank) gives exactly shard_weights' tensors.
TEST(TpShard, CheckpointBlocksAreTheShards) {
  for (int hkv : {4, 2, 1}) {
    ModelConfig c = shape(4, hkv, 128, true);  // q/k/v and o_proj biases too
    ModelWeights w = random_weights(c, 11);
    const std::vector<WeightTensor> full = weight_tensors(w);
    for (int tp : {1, 2, 4}) {
      for (int r = 0; r < tp; ++r) {
        SCOPED_TRACE("Hkv " + std::to_string(hkv) + " tp " + std::to_string(tp) + " rank " + std::to_string(r));
        ModelWeights shard = shard_weights(w, r, tp);
        const std::vector<WeightTensor> local = weight_tensors(shard);
        ASSERT_EQ(local.size(), full.size());
        const TpShard sh = tp_shard(c, r, tp);
        for (size_t i = 0; i < full.size(); ++i) {
          ASSERT_EQ(local[i].name, full[i].name);
          const TpBlock b = tp_block(sh, full[i].name, full[i].shape);
          const int64_t pitch = full[i].shape.size() == 2 ? full[i].shape[1] : 1;
          std::vector<float> got;
          for (int64_t row = 0; row < b.rows; ++row)
            for (int64_t col = 0; col < b.cols; ++col)
              got.push_back(b.zeros ? 0.0f : (*full[i].data)[static_cast<size_t>((b.row_begin + row) * pitch + b.col_begin + col)]);
          EXPECT_EQ(got, *local[i].data) << full[i].name;
        }
      }
    }
  }
  const TpShard sh = tp_shard(shape(4, 2, 128), 1, 2);
  const std::vector<int64_t> bad_rows{100, 128}, q{512, 128}, norm{128};
  expect_error([&] { tp_block(sh, "model.layers.0.self_attn.q_proj.weight", bad_rows); }, {"q_proj", "100 rows"});
  expect_error([&] { tp_block(sh, "model.layers.0.self_attn.o_proj.weight", norm); }, {"o_proj", "columns"});
  expect_error([&] { tp_block(sh, "model.layers.0.mlp.experts.0.weight", q); }, {"experts", "not a tensor"});
}

TEST(TpShard, IndivisibleShapesAreClearErrors) {
  expect_error([] { check_tp(shape(4, 2, 128), 3); }, {"4 attention heads", "tp 3"});
  expect_error([] { check_tp(shape(12, 4, 96), 6); }, {"4 kv heads", "tp 6", "replicate"});
  expect_error([] { check_tp(shape(4, 4, 130), 4); }, {"intermediate_size 130", "tp 4"});
  expect_error([] { check_tp(shape(4, 4, 128), 0); }, {"at least 1"});
  expect_error([] { tp_shard(shape(4, 4, 128), 2, 2); }, {"rank 2", "[0, 2)"});
  const ModelWeights w = random_weights(shape(4, 2, 128), 1);
  expect_error([&] { shard_weights(w, 0, 3); }, {"attention heads", "tp 3"});
  expect_error([&] { TpCpuModel(w, 16, {.tp = 3}); }, {"attention heads", "tp 3"});
  // A tensor of the wrong size is refused before anything is sliced.
  ModelWeights bad = w;
  bad.layers[1].wo.pop_back();
  expect_error([&] { shard_weights(bad, 1, 2); }, {"layer 1 o_proj", "holds"});
}

// ---- LocalGroup ------------------------------------------------------------------------------

TEST(LocalGroup, SumsAreExactAndIdenticalOnEveryRank) {
  for (int n : {1, 2, 3, 4}) {
    LocalGroup group(n, std::chrono::milliseconds(5000));
    constexpr int kRounds = 50;
    std::vector<std::vector<std::vector<float>>> results(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        Communicator& comm = group.comm(r);
        EXPECT_EQ(comm.rank(), r);
        EXPECT_EQ(comm.size(), n);
        for (int round = 0; round < kRounds; ++round) {
          const size_t len = static_cast<size_t>(round % 7) * 3;  // includes empty spans
          std::vector<float> x = test::random_floats(len, static_cast<uint64_t>(1000 * round + r));
          comm.all_reduce_sum(x);
          results[static_cast<size_t>(r)].push_back(x);
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(group.completed(), kRounds);
    for (int round = 0; round < kRounds; ++round) {
      const size_t len = static_cast<size_t>(round % 7) * 3;
      std::vector<float> want(len, 0.0f);
      for (int r = 0; r < n; ++r) {
        const std::vector<float> x = test::random_floats(len, static_cast<uint64_t>(1000 * round + r));
        for (size_t i = 0; i < len; ++i) want[i] += x[i];
      }
      for (int r = 0; r < n; ++r) EXPECT_EQ(results[static_cast<size_t>(r)][static_cast<size_t>(round)], want);
    }
  }
}

TEST(LocalGroup, MissingRankTimesOutOnEveryWaitingRank) {
  LocalGroup group(3, std::chrono::milliseconds(100));
  std::vector<std::string> errors(2);
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {  // rank 2 never arrives
    threads.emplace_back([&, r] {
      std::vector<float> x(4, 1.0f);
      try {
        group.comm(r).all_reduce_sum(x);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.message();
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_LT(elapsed_ms(t0), 3000.0);
  for (const std::string& e : errors) {
    EXPECT_FALSE(e.empty());
    EXPECT_NE(e.find("timed out after 100 ms"), std::string::npos) << e;
  }
  EXPECT_TRUE(group.aborted());
  EXPECT_NE(group.abort_reason().find("rank(s) 2"), std::string::npos) << group.abort_reason();
  // The late rank fails at once instead of waiting.
  std::vector<float> x(4, 1.0f);
  expect_error([&] { group.comm(2).all_reduce_sum(x); }, {"rank 2 of 3", "aborted", "timed out"});
  // reset() makes the group usable again.
  group.reset();
  std::vector<std::thread> again;
  std::vector<std::vector<float>> bufs(3, std::vector<float>(2, 2.0f));
  for (int r = 0; r < 3; ++r) again.emplace_back([&, r] { group.comm(r).all_reduce_sum(bufs[static_cast<size_t>(r)]); });
  for (auto& t : again) t.join();
  for (const auto& b : bufs) EXPECT_EQ(b, std::vector<float>(2, 6.0f));
}

TEST(LocalGroup, AbortWakesWaitingRanksAtOnce) {
  LocalGroup group(3, std::chrono::milliseconds(20000));
  std::vector<std::string> errors(2);
  const auto t0 = Clock::now();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> x(4, 1.0f);
      try {
        group.comm(r).all_reduce_sum(x);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.message();
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  group.abort(2, "out of memory");  // rank 2 failed before its collective
  for (auto& t : threads) t.join();
  EXPECT_LT(elapsed_ms(t0), 5000.0);  // far below the 20 s timeout
  for (const std::string& e : errors) EXPECT_NE(e.find("rank 2: out of memory"), std::string::npos) << e;
}

TEST(LocalGroup, MismatchedLengthsFailOnEveryRank) {
  LocalGroup group(2, std::chrono::milliseconds(5000));
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      std::vector<float> x(static_cast<size_t>(3 + r), 1.0f);
      try {
        group.comm(r).all_reduce_sum(x);
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.message();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_NE(e.find("different lengths"), std::string::npos) << e;
  expect_error([] { LocalGroup(0); }, {"size must be at least 1"});
  expect_error([&] { group.comm(2); }, {"no rank 2"});
}

// ---- TpCpuModel vs CpuModel ----------------------------------------------------------------

struct GoldenModel {
  std::string dir;
  ModelWeights weights;
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::vector<int32_t>> greedy;
};

std::vector<GoldenModel> golden_models() {
  std::vector<GoldenModel> out;
  for (const std::string& dir : test::golden_dirs()) {
    const test::Golden g = test::load_golden(dir);
    GoldenModel m;
    m.dir = dir;
    m.weights = load_weights(SafetensorsFolder(dir), load_model_config(dir));
    m.prompts = g.prompts;
    m.greedy = g.greedy;
    out.push_back(std::move(m));
  }
  return out;
}

const std::vector<GoldenModel>& goldens() {
  static const std::vector<GoldenModel> models = golden_models();
  return models;
}

#define SKIP_WITHOUT_GOLDEN()                                                                 \
  if (goldens().empty()) GTEST_SKIP() << "no golden data in data/golden/ (see test_engine_golden.cpp)"

// |got - want| <= 1e-4 * max(1, |want|) element-wise.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double tol = 1e-4 * std::max(1.0, std::abs(static_cast<double>(want[i])));
    if (std::abs(static_cast<double>(got[i]) - want[i]) > tol && ++bad <= 3)
      ADD_FAILURE() << what << ": element " << i << ": " << got[i] << " vs " << want[i];
  }
}

CpuModelOptions one_thread() {
  CpuModelOptions o;
  o.num_threads = 1;
  return o;
}

TpCpuModelOptions tp_options(int tp) {
  TpCpuModelOptions o;
  o.tp = tp;
  o.threads_per_rank = 1;
  o.collective_timeout = std::chrono::milliseconds(20000);
  return o;
}

// Prefills every prompt, then decodes `steps` greedy tokens for all prompts together; returns
// the logits of every call in order and the tokens.
struct Trace {
  std::vector<std::vector<float>> logits;
  std::vector<std::vector<int32_t>> tokens;
};

Trace greedy_trace(DecoderModel& model, const std::vector<std::vector<int32_t>>& prompts, int steps,
                   DecodeAttention attention) {
  Trace t;
  const size_t np = prompts.size();
  std::vector<std::vector<int32_t>> paths(np);
  std::vector<int32_t> last(np);
  t.tokens.resize(np);
  int32_t next_slot = 0;
  for (size_t p = 0; p < np; ++p) {
    std::vector<int32_t> pos(prompts[p].size()), slots(prompts[p].size());
    for (size_t i = 0; i < pos.size(); ++i) {
      pos[i] = static_cast<int32_t>(i);
      slots[i] = next_slot++;
    }
    t.logits.push_back(model.prefill(prompts[p], pos, slots, {}));
    last[p] = greedy_token(t.logits.back());
    t.tokens[p].push_back(last[p]);
    paths[p] = slots;
  }
  const size_t vocab = static_cast<size_t>(model.config().vocab_size);
  for (int step = 1; step < steps; ++step) {
    std::vector<int32_t> tokens(np), pos(np), slots(np);
    for (size_t p = 0; p < np; ++p) {
      tokens[p] = last[p];
      pos[p] = static_cast<int32_t>(paths[p].size());
      slots[p] = next_slot++;
      paths[p].push_back(slots[p]);
    }
    const KvTree tree = kv_tree_from_paths(paths, PathSharing::kShared);
    t.logits.push_back(model.decode({tokens, pos, slots, &tree}, attention));
    for (size_t p = 0; p < np; ++p) {
      last[p] = greedy_token(std::span<const float>(t.logits.back()).subspan(p * vocab, vocab));
      t.tokens[p].push_back(last[p]);
    }
  }
  return t;
}

TEST(TpCpuModel, MatchesCpuModelOnGoldenCheckpoints) {
  SKIP_WITHOUT_GOLDEN();
  for (const GoldenModel& g : goldens()) {
    const int steps = static_cast<int>(g.greedy[0].size());
    CpuModel ref(g.weights, 128, one_thread());
    const Trace want = greedy_trace(ref, g.prompts, steps, DecodeAttention::kFastTree);
    EXPECT_EQ(want.tokens, g.greedy) << g.dir;
    for (int tp : {1, 2, 4}) {
      SCOPED_TRACE(g.dir + " tp " + std::to_string(tp));
      TpCpuModel model(g.weights, 128, tp_options(tp));
      EXPECT_EQ(model.config(), g.weights.config);
      const Trace got = greedy_trace(model, g.prompts, steps, DecodeAttention::kFastTree);
      ASSERT_EQ(got.logits.size(), want.logits.size());
      for (size_t i = 0; i < want.logits.size(); ++i) expect_close(got.logits[i], want.logits[i], "call " + std::to_string(i));
      EXPECT_EQ(got.tokens, want.tokens);
      // The plan was made once, with the rank-local heads.
      EXPECT_EQ(model.last_plan().num_qo_heads, g.weights.config.num_attention_heads / tp);
      // Each rank's KV pool shard holds its kv heads' K/V of the unsharded pool.
      const ModelConfig& c = g.weights.config;
      const int64_t d = c.head_dim;
      for (int r = 0; r < tp; ++r) {
        const TpShard& s = model.shard(r);
        const std::span<const float> full = ref.k_cache(1), part = model.rank_model(r).k_cache(1);
        ASSERT_EQ(part.size(), static_cast<size_t>(128 * s.kv_rows()));
        double worst = 0;
        for (int64_t slot = 0; slot < 40; ++slot)
          for (int64_t j = 0; j < s.kv_rows(); ++j)
            worst = std::max(worst, static_cast<double>(std::abs(part[static_cast<size_t>(slot * s.kv_rows() + j)] -
                                                                 full[static_cast<size_t>(slot * c.kv_dim() + s.kv_head_begin * d + j)])));
        EXPECT_LT(worst, 1e-4) << "rank " << r;
      }
    }
  }
}

TEST(TpCpuModel, ReferenceAttentionAndAllLogitsMatch) {
  SKIP_WITHOUT_GOLDEN();
  const GoldenModel& g = goldens().front();
  CpuModel ref(g.weights, 64, one_thread());
  TpCpuModel model(g.weights, 64, tp_options(2));
  const Trace want = greedy_trace(ref, g.prompts, 3, DecodeAttention::kReference);
  const Trace got = greedy_trace(model, g.prompts, 3, DecodeAttention::kReference);
  for (size_t i = 0; i < want.logits.size(); ++i) expect_close(got.logits[i], want.logits[i], "call " + std::to_string(i));
  // Logits of every prompt position.
  const auto& p = g.prompts.back();
  std::vector<int32_t> pos(p.size()), slots(p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    pos[i] = static_cast<int32_t>(i);
    slots[i] = static_cast<int32_t>(40 + i);
  }
  expect_close(model.prefill(p, pos, slots, {}, true), ref.prefill(p, pos, slots, {}, true), "all logits");
}

// A llama with attention_bias has an o_proj bias, added after a row-parallel GEMM: it must count once.
TEST(TpCpuModel, OProjBiasCountsOnce) {
  ModelConfig c = shape(4, 2, 128, true);
  const ModelWeights w = random_weights(c, 11);
  CpuModel ref(w, 32, one_thread());
  const std::vector<int32_t> tokens = {3, 200, 17, 45, 99, 1};
  std::vector<int32_t> pos(tokens.size()), slots(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) pos[i] = slots[i] = static_cast<int32_t>(i);
  const std::vector<float> want = ref.prefill(tokens, pos, slots, {}, true);
  for (int tp : {2, 4}) {
    TpCpuModel model(w, 32, tp_options(tp));
    expect_close(model.prefill(tokens, pos, slots, {}, true), want, "tp " + std::to_string(tp));
  }
}

TEST(TpCpuModel, SchedulerGivesTheSameTokens) {
  SKIP_WITHOUT_GOLDEN();
  for (const GoldenModel& g : goldens()) {
    for (int tp : {2, 4}) {
      SCOPED_TRACE(g.dir + " tp " + std::to_string(tp));
      TpCpuModel model(g.weights, 256, tp_options(tp));
      Scheduler s(model);  // plans with the whole model's shape; the model adapts the plan per rank
      for (size_t p = 0; p < g.prompts.size(); ++p) {
        GenerationRequest r;
        r.prompt = g.prompts[p];
        r.max_new_tokens = static_cast<int>(g.greedy[p].size());
        r.n = p == 0 ? 2 : 1;
        s.submit(r);
      }
      const auto results = s.run();
      ASSERT_EQ(results.size(), g.prompts.size());
      for (size_t p = 0; p < g.prompts.size(); ++p)
        for (const auto& sample : results[p].samples) EXPECT_EQ(sample, g.greedy[p]) << "prompt " << p;
      EXPECT_GT(s.stats().plan_extensions, 0);
    }
  }
}

TEST(TpCpuModel, BadInputsAndPlansAreClearErrors) {
  const ModelWeights w = random_weights(shape(4, 2, 128), 3);
  TpCpuModel model(w, 16, tp_options(2));
  const std::vector<int32_t> tokens = {1, 256}, pos = {0, 1}, slots = {0, 1};
  expect_error([&] { model.prefill(tokens, pos, slots, {}); }, {"tensor-parallel step failed", "outside the vocabulary"});
  EXPECT_EQ(model.last_rank_errors().size(), 2u);
  // A plan for other head counts is refused.
  const std::vector<std::vector<int32_t>> paths = {{0, 1}};
  const KvTree tree = kv_tree_from_paths(paths);
  Plan plan;
  Planner planner;
  planner.build(tree, AttnShape{8, 2, 16}, plan);
  const std::vector<int32_t> t1 = {5}, p1 = {1}, s1 = {1};
  expect_error([&] { model.decode({t1, p1, s1, &tree, &plan}); }, {"plan was built for 8/2", "4/2"});
  // Still usable.
  const std::vector<int32_t> ok = {1, 2};
  EXPECT_EQ(model.prefill(ok, pos, slots, {}).size(), 256u);
}

// A rank that throws in the middle of a step: every rank stops with an error at once (the group is
// aborted, nobody waits for the timeout), and the model works again afterwards.
TEST(TpCpuModel, RankThrowingMidStepStopsEveryRank) {
  const ModelWeights w = random_weights(shape(4, 4, 128), 5);
  CpuModel ref(w, 32, one_thread());
  std::atomic<bool> inject{true};
  TpCpuModelOptions o = tp_options(4);
  o.collective_timeout = std::chrono::milliseconds(20000);
  o.before_all_reduce = [&](int rank, int64_t index) {
    if (inject.load() && rank == 2 && index == 2) throw Error("injected failure", __FILE__, __LINE__);
  };
  TpCpuModel model(w, 32, o);
  const std::vector<int32_t> tokens = {3, 4, 5}, pos = {0, 1, 2}, slots = {0, 1, 2};
  const auto t0 = Clock::now();
  expect_error([&] { model.prefill(tokens, pos, slots, {}); }, {"rank 2", "injected failure", "4 of 4 ranks"});
  EXPECT_LT(elapsed_ms(t0), 5000.0);
  const auto& errors = model.last_rank_errors();
  ASSERT_EQ(errors.size(), 4u);
  EXPECT_NE(errors[2].find("injected failure"), std::string::npos);
  for (int r : {0, 1, 3}) EXPECT_NE(errors[static_cast<size_t>(r)].find("aborted"), std::string::npos) << errors[static_cast<size_t>(r)];
  inject = false;
  expect_close(model.prefill(tokens, pos, slots, {}), ref.prefill(tokens, pos, slots, {}), "after the failure");
}

// A rank that is stuck past the timeout: the waiting ranks time out and abort, the late rank
// fails when it arrives; no hang.
TEST(TpCpuModel, SlowRankTimesOut) {
  const ModelWeights w = random_weights(shape(4, 2, 128), 6);
  std::atomic<bool> slow{true};
  TpCpuModelOptions o = tp_options(2);
  o.collective_timeout = std::chrono::milliseconds(150);
  o.before_all_reduce = [&](int rank, int64_t index) {
    if (slow.load() && rank == 1 && index == 1) std::this_thread::sleep_for(std::chrono::milliseconds(600));
  };
  TpCpuModel model(w, 32, o);
  const std::vector<int32_t> tokens = {3, 4}, pos = {0, 1}, slots = {0, 1};
  const auto t0 = Clock::now();
  expect_error([&] { model.prefill(tokens, pos, slots, {}); }, {"rank 0", "timed out after 150 ms", "2 of 2 ranks"});
  EXPECT_LT(elapsed_ms(t0), 5000.0);
  EXPECT_NE(model.last_rank_errors()[1].find("aborted"), std::string::npos) << model.last_rank_errors()[1];
  slow = false;
  EXPECT_EQ(model.prefill(tokens, pos, slots, {}).size(), 256u);
}

// ---- NcclComm (no GPU needed) ------------------------------------------------------------------

TEST(NcclComm, BadArgumentsAndMissingGpusAreClearErrors) {
  const std::vector<int> one = {0};
  if (!nccl_available()) {
    expect_error([] { nccl_unique_id(); }, {"NCCL not available"});
    expect_error([&] { NcclComm::create_group(one); }, {"NCCL not available"});
    expect_error([] { NcclComm(NcclId{}, 0, 1, 0); }, {"NCCL not available"});
    return;
  }
  expect_error([] { NcclComm::create_group(std::span<const int>()); }, {"no devices"});
  const std::vector<int> twice = {0, 0}, negative = {-1};
  expect_error([&] { NcclComm::create_group(twice); }, {"device 0 given twice"});
  expect_error([&] { NcclComm::create_group(negative); }, {"negative device -1"});
  expect_error([] { NcclComm(NcclId{}, 2, 2, 0); }, {"rank 2 outside a communicator of 2"});
  if (cuda_device_count() == 0) {
    // No GPU: an error (from CUDA), never a crash or a hang.
    EXPECT_THROW(NcclComm::create_group(one), Error);
  } else {
    const std::vector<int> missing = {0, cuda_device_count()};
    expect_error([&] { NcclComm::create_group(missing); }, {"is missing"});
  }
}

}  // namespace
}  // namespace fasttree
