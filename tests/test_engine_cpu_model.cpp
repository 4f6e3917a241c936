// CpuModel (engine/cpu_model.h) on tiny random models (llama GQA-2, mistral GQA-4, qwen2 with
// biases and tied embeddings, llama with Llama-3 RoPE scaling):
//   (a) prefill of a whole sequence == prefill of a prefix, then token-by-token decode (and a
//       chunked prefill): last-position logits rel. err <= 1e-4;
//   (b) decoding several requests that share prefixes (radix cache -> build_kv_tree) in one batch
//       through the FastTree plan == decoding each request alone (<= 1e-5), for planner configs
//       with and without context splitting; and FastTree == reference attention on the batch;
//   (c) a model loaded from a safetensors checkpoint of random weights == the model built from them;
//   plus every bad input -> fasttree::Error.
// rel. err = max |a - b| / max |b| over a logits row.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/cache_tree.h"
#include "core/radix_cache.h"
#include "core/slot_pool.h"
#include "engine/cpu_model.h"
#include "engine/safetensors.h"
#include "engine/sampler.h"
#include "engine/slot_paths.h"
#include "engine/weights.h"
#include "engine_test_util.h"

namespace fasttree {
namespace {

using test::expect_error;
using test::rel_err;
using Vec = std::vector<int32_t>;

constexpr int kThreads = 2;

struct NamedConfig {
  const char* name;
  ModelConfig config;
};

std::vector<NamedConfig> tiny_configs() {
  std::vector<NamedConfig> out;
  out.push_back({"llama", model_preset("tiny")});
  ModelConfig m = model_preset("tiny");
  m.model_type = "mistral";
  m.num_attention_heads = 8;
  m.num_key_value_heads = 2;
  m.head_dim = 8;
  m.rope_theta = 1e6;
  out.push_back({"mistral_gqa4", m});
  ModelConfig q = model_preset("tiny");
  q.model_type = "qwen2";
  q.attention_bias = true;
  q.tie_word_embeddings = true;
  q.num_key_value_heads = 1;
  out.push_back({"qwen2_bias_tied", q});
  ModelConfig l3 = model_preset("tiny");
  l3.rope_scaling = {RopeScalingType::kLlama3, 4.0, 1.0, 4.0, 512};  // d = 16: every regime occurs
  out.push_back({"llama3_scaling", l3});
  ModelConfig lb = model_preset("tiny");
  lb.attention_bias = true;  // llama: q/k/v and o_proj biases
  lb.num_key_value_heads = 4;
  out.push_back({"llama_bias_mha", lb});
  return out;
}

Vec random_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Vec t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

Vec iota_vec(int begin, int end) {
  Vec v(static_cast<size_t>(end - begin));
  std::iota(v.begin(), v.end(), begin);
  return v;
}

Vec sub(const Vec& v, size_t b, size_t e) { return Vec(v.begin() + static_cast<std::ptrdiff_t>(b), v.begin() + static_cast<std::ptrdiff_t>(e)); }

std::vector<float> row(const std::vector<float>& m, int64_t r, int64_t width) {
  return std::vector<float>(m.begin() + r * width, m.begin() + (r + 1) * width);
}

CpuModelOptions options(bool split) {
  CpuModelOptions o;
  o.num_threads = kThreads;
  if (split) {  // force context chunks and multi-partial merges on tiny contexts
    o.planner.num_sms = 16;
    o.planner.min_chunk = 3;
    o.planner.split_waves = 2.0;
  }
  return o;
}

TEST(EngineCpuModel, PrefillEqualsPrefixThenDecode) {
  for (const NamedConfig& nc : tiny_configs()) {
    SCOPED_TRACE(nc.name);
    const ModelConfig& c = nc.config;
    const ModelWeights w = random_weights(c, 1234);
    const int n = 24, p = 9;
    const Vec tokens = random_tokens(n, static_cast<int>(c.vocab_size), 99);
    const Vec positions = iota_vec(0, n);
    // Scattered, shuffled slots catch any slot/position mix-up.
    Vec slots = iota_vec(0, 64);
    std::shuffle(slots.begin(), slots.end(), std::mt19937_64(5));
    slots.resize(n);

    CpuModel whole(w, 64, options(false));
    const std::vector<float> all = whole.prefill(tokens, positions, slots, {}, /*all_logits=*/true);
    ASSERT_EQ(all.size(), static_cast<size_t>(n * c.vocab_size));
    const std::vector<float> last = whole.prefill(tokens, positions, slots, {});
    EXPECT_EQ(last, row(all, n - 1, c.vocab_size));
    double max_abs = 0;
    for (float x : last) max_abs = std::max(max_abs, static_cast<double>(std::abs(x)));
    EXPECT_GT(max_abs, 0.1);  // activations stay O(1): logits neither vanish nor explode
    EXPECT_LT(max_abs, 50.0);

    // Chunked prefill: prefix, then the rest with the prefix as cached context.
    CpuModel chunked(w, 64, options(false));
    chunked.prefill(sub(tokens, 0, p), sub(positions, 0, p), sub(slots, 0, p), {});
    const std::vector<float> rest =
        chunked.prefill(sub(tokens, p, n), sub(positions, p, n), sub(slots, p, n), sub(slots, 0, p), true);
    for (int i = p; i < n; ++i)
      EXPECT_LE(rel_err(row(rest, i - p, c.vocab_size), row(all, i, c.vocab_size)), 1e-4) << "chunk row " << i;

    // Prefix prefill, then one token per decode step, through FastTree (with and without
    // splitting) and through the reference attention.
    for (int mode = 0; mode < 3; ++mode) {
      CpuModel m(w, 64, options(mode == 1));
      const DecodeAttention att = mode == 2 ? DecodeAttention::kReference : DecodeAttention::kFastTree;
      const std::vector<float> first = m.prefill(sub(tokens, 0, p), sub(positions, 0, p), sub(slots, 0, p), {});
      EXPECT_LE(rel_err(first, row(all, p - 1, c.vocab_size)), 1e-4);
      for (int i = p; i < n; ++i) {
        const std::vector<Vec> paths = {sub(slots, 0, static_cast<size_t>(i) + 1)};
        const KvTree tree = kv_tree_from_paths(paths);
        const Vec tok = {tokens[i]}, pos = {positions[i]}, slot = {slots[i]};
        const std::vector<float> logits = m.decode({tok, pos, slot, &tree}, att);
        EXPECT_LE(rel_err(logits, row(all, i, c.vocab_size)), 1e-4) << "mode " << mode << " step " << i;
      }
    }
  }
}

// A request of the shared-prefix test: prompt, cache node, and the tail slots of decoded tokens.
struct Req {
  Vec prompt;
  LiveRequest live;
  int32_t next_token = 0;
};

TEST(EngineCpuModel, SharedPrefixBatchEqualsRequestsAlone) {
  for (const NamedConfig& nc : tiny_configs()) {
    for (bool split : {false, true}) {
      SCOPED_TRACE(std::string(nc.name) + (split ? " split" : ""));
      const ModelConfig& c = nc.config;
      const int vocab = static_cast<int>(c.vocab_size);
      const ModelWeights w = random_weights(c, 777);
      const int32_t num_slots = 256;
      CpuModel batched(w, num_slots, options(split));  // FastTree, one batch
      CpuModel alone(w, num_slots, options(split));    // FastTree, each request alone
      CpuModel ref(w, num_slots, options(split));      // reference attention, one batch
      std::vector<CpuModel*> models = {&batched, &alone, &ref};

      // Prompts: system S, two variants under it, private questions; one request right under S.
      const Vec s = random_tokens(20, vocab, 1), v0 = random_tokens(6, vocab, 2), v1 = random_tokens(7, vocab, 3);
      auto cat = [](std::initializer_list<Vec> parts) {
        Vec out;
        for (const Vec& p : parts) out.insert(out.end(), p.begin(), p.end());
        return out;
      };
      std::vector<Req> reqs(5);
      reqs[0].prompt = cat({s, v0, random_tokens(3, vocab, 10)});
      reqs[1].prompt = cat({s, v0, random_tokens(5, vocab, 11)});
      reqs[2].prompt = cat({s, v1, random_tokens(4, vocab, 12)});
      reqs[3].prompt = cat({s, v1, random_tokens(3, vocab, 13)});
      reqs[4].prompt = cat({s, random_tokens(4, vocab, 14)});

      // Prefill through the radix cache, computing only uncached tokens (the same calls on every
      // model, so their KV pools are identical).
      SlotPool pool(num_slots);
      RadixCache cache(pool);
      int64_t reused = 0;
      for (Req& r : reqs) {
        const RadixCache::MatchResult m = cache.match_prefix(r.prompt);
        cache.lock(m.node);
        reused += m.length;
        const Vec tail = pool.alloc(static_cast<int64_t>(r.prompt.size()) - m.length);
        const Vec new_tokens = sub(r.prompt, static_cast<size_t>(m.length), r.prompt.size());
        const Vec positions = iota_vec(static_cast<int>(m.length), static_cast<int>(r.prompt.size()));
        std::vector<float> logits;
        for (CpuModel* model : models) logits = model->prefill(new_tokens, positions, tail, m.slots);
        Vec all_slots = m.slots;
        all_slots.insert(all_slots.end(), tail.begin(), tail.end());
        const RadixCache::InsertResult ins = cache.insert(r.prompt, all_slots);
        ASSERT_EQ(ins.cached_prefix, m.length);
        cache.lock(ins.node);
        cache.unlock(m.node);
        r.live.node = ins.node;
        r.next_token = greedy_token(logits);
      }
      EXPECT_EQ(reused, 0 + 26 + 20 + 27 + 20);  // S and S+variant prefilled once

      for (int step = 0; step < 3; ++step) {
        Vec tokens, positions, slots;
        std::vector<LiveRequest> live;
        for (Req& r : reqs) {
          const int32_t slot = pool.alloc(1)[0];
          r.live.tail_slots.push_back(slot);
          tokens.push_back(r.next_token);
          positions.push_back(static_cast<int32_t>(r.prompt.size() + r.live.tail_slots.size() - 1));
          slots.push_back(slot);
          live.push_back(r.live);
        }
        const KvTree tree = build_kv_tree(cache, live);
        const int b = static_cast<int>(reqs.size());
        const std::vector<float> got = batched.decode({tokens, positions, slots, &tree});
        const std::vector<float> want_ref = ref.decode({tokens, positions, slots, &tree}, DecodeAttention::kReference);
        const Plan& plan = batched.last_plan();
        int shared_vnodes = 0;
        for (int v = 0; v < plan.num_vnodes(); ++v)
          shared_vnodes += plan.vnode_q_begin[v + 1] - plan.vnode_q_begin[v] > 1;
        EXPECT_GT(shared_vnodes, 0) << "the plan shares nothing";
        if (split) {
          EXPECT_GT(plan.num_partial_rows, 0) << "no merged partials";
        }
        for (int r = 0; r < b; ++r) {
          const std::vector<LiveRequest> one = {live[r]};
          const KvTree t1 = build_kv_tree(cache, one);
          const Vec tok = {tokens[r]}, pos = {positions[r]}, sl = {slots[r]};
          const std::vector<float> solo = alone.decode({tok, pos, sl, &t1});
          const auto g = row(got, r, c.vocab_size);
          EXPECT_LE(rel_err(g, solo), 1e-5) << "step " << step << " request " << r;
          EXPECT_LE(rel_err(g, row(want_ref, r, c.vocab_size)), 1e-5) << "step " << step << " request " << r;
          reqs[r].next_token = greedy_token(g);
        }
      }
      // Per-request trees (nothing shared) give the same answer as the shared tree.
      for (Req& r : reqs) r.live.tail_slots.pop_back();
      std::vector<Vec> paths;
      Vec tokens, positions, slots;
      for (Req& r : reqs) {
        Vec path = cache.match_prefix(r.prompt).slots;
        path.insert(path.end(), r.live.tail_slots.begin(), r.live.tail_slots.end());
        const int32_t slot = pool.alloc(1)[0];
        path.push_back(slot);
        paths.push_back(path);
        tokens.push_back(r.next_token);
        positions.push_back(static_cast<int32_t>(path.size() - 1));
        slots.push_back(slot);
      }
      const KvTree shared = kv_tree_from_paths(paths), separate = kv_tree_from_paths(paths, PathSharing::kPerRequest);
      const auto a = batched.decode({tokens, positions, slots, &shared});
      const auto bb = alone.decode({tokens, positions, slots, &separate});
      for (int r = 0; r < static_cast<int>(reqs.size()); ++r)
        EXPECT_LE(rel_err(row(a, r, c.vocab_size), row(bb, r, c.vocab_size)), 1e-5) << r;
    }
  }
}

TEST(EngineCpuModel, LoadedCheckpointEqualsRandomWeights) {
  test::TempDir dir;
  const ModelConfig c = tiny_configs()[2].config;  // qwen2: biases + tied embeddings
  const ModelWeights w = random_weights(c, 55);
  save_weights(w, dir.path("model.safetensors"));
  const ModelWeights loaded = load_weights(SafetensorsFolder(dir.path()), c);
  CpuModel a(w, 32, options(false)), b(loaded, 32, options(false));
  const Vec tokens = random_tokens(7, static_cast<int>(c.vocab_size), 8);
  const Vec pos = iota_vec(0, 7), slots = iota_vec(3, 10);
  EXPECT_EQ(a.prefill(tokens, pos, slots, {}, true), b.prefill(tokens, pos, slots, {}, true));
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    EXPECT_TRUE(std::equal(a.k_cache(l).begin(), a.k_cache(l).end(), b.k_cache(l).begin()));
    EXPECT_TRUE(std::equal(a.v_cache(l).begin(), a.v_cache(l).end(), b.v_cache(l).begin()));
  }
}

TEST(EngineCpuModel, BadInputs) {
  const ModelConfig c = model_preset("tiny");
  CpuModel m(random_weights(c, 3), 16, options(false));
  const Vec t3 = {1, 2, 3}, p3 = {0, 1, 2}, s3 = {4, 5, 6};
  expect_error([&] { m.prefill({}, {}, {}, {}); }, {"prefill: no tokens"});
  expect_error([&] { m.prefill(Vec{1, 256, 3}, p3, s3, {}); }, {"token 256", "vocabulary"});
  expect_error([&] { m.prefill(t3, Vec{0, -1, 2}, s3, {}); }, {"negative position"});
  expect_error([&] { m.prefill(t3, p3, Vec{4, 16, 6}, {}); }, {"slot 16", "out of range"});
  expect_error([&] { m.prefill(t3, p3, Vec{4, 5, 4}, {}); }, {"slot 4", "two tokens"});
  expect_error([&] { m.prefill(t3, Vec{0, 1}, s3, {}); }, {"3 tokens but 2 positions"});
  expect_error([&] { m.prefill(t3, p3, s3, Vec{0, 5}); }, {"slot 5", "twice"});
  expect_error([&] { m.prefill(t3, p3, s3, Vec{0, 99}); }, {"slot 99"});
  m.prefill(t3, p3, s3, {});

  const std::vector<Vec> paths = {{4, 5, 6, 7}};
  const KvTree tree = kv_tree_from_paths(paths);
  expect_error([&] { m.decode({Vec{1}, Vec{3}, Vec{8}, &tree}); }, {"ends with slot 7", "new slot 8"});
  expect_error([&] { m.decode({Vec{1, 2}, Vec{3, 3}, Vec{7, 8}, &tree}); }, {"1 queries for 2 requests"});
  expect_error([&] { m.decode({Vec{1}, Vec{3}, Vec{7}, nullptr}); }, {"no tree"});
  const std::vector<Vec> far = {{4, 5, 6, 70}};
  const KvTree far_tree = kv_tree_from_paths(far);
  expect_error([&] { m.decode({Vec{1}, Vec{3}, Vec{7}, &far_tree}); }, {"slot 70"});
  const KvTree empty_tree;
  EXPECT_TRUE(m.decode({Vec{}, Vec{}, Vec{}, &empty_tree}).empty());

  ModelConfig sw = model_preset("tiny");
  sw.model_type = "mistral";
  sw.sliding_window = 4;
  CpuModel ms(random_weights(sw, 3), 16, options(false));
  expect_error([&] { ms.prefill(Vec{1, 2, 3, 4, 5}, iota_vec(0, 5), iota_vec(0, 5), {}); }, {"sliding window of 4"});

  ModelWeights broken = random_weights(c, 4);
  broken.layers[1].w_down.pop_back();
  expect_error([&] { CpuModel x(broken, 16); }, {"model.layers.1.mlp.down_proj.weight", "[64, 128]"});
  expect_error([&] { CpuModel x(random_weights(c, 4), 0); }, {"num_slots"});
  expect_error([&] { CpuModel x(random_weights(c, 4), 2000000000); }, {"KV pool of 2000000000 slots", "GiB"});
}

}  // namespace
}  // namespace fasttree
