#include "cpu/reference.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "cpu/parallel.h"

namespace fasttree {

namespace {

std::string sz(size_t n) { return std::to_string(n); }

}  // namespace

void reference_attention(const KvTree& tree, const AttnShape& shape, std::span<const float> q,
                         std::span<const float> k, std::span<const float> v, float sm_scale,
                         std::span<float> out, std::span<float> lse, int num_threads) {
  shape.validate();
  const int64_t nq = tree.num_queries();
  const int64_t hq = shape.num_qo_heads;
  const int64_t hkv = shape.num_kv_heads;
  const int64_t d = shape.head_dim;
  const int g = shape.gqa();

  FT_CHECK(q.size() == static_cast<size_t>(nq * hq * d),
           "reference_attention: q has " + sz(q.size()) + " floats, expected num_queries*Hq*d = " +
               std::to_string(nq) + "*" + std::to_string(hq) + "*" + std::to_string(d));
  FT_CHECK(out.size() == static_cast<size_t>(nq * hq * d),
           "reference_attention: out has " + sz(out.size()) + " floats, expected num_queries*Hq*d = " +
               std::to_string(nq * hq * d));
  FT_CHECK(lse.empty() || lse.size() == static_cast<size_t>(nq * hq),
           "reference_attention: lse has " + sz(lse.size()) + " floats, expected 0 or num_queries*Hq = " +
               std::to_string(nq * hq));
  FT_CHECK(k.size() % static_cast<size_t>(hkv * d) == 0,
           "reference_attention: k has " + sz(k.size()) + " floats, not a multiple of Hkv*d = " +
               std::to_string(hkv * d));
  FT_CHECK(v.size() == k.size(), "reference_attention: v has " + sz(v.size()) + " floats but k has " +
                                     sz(k.size()));
  const int64_t num_slots = static_cast<int64_t>(k.size()) / (hkv * d);
  validate_tree(tree, num_slots);

  const double scale = static_cast<double>(sm_scale);
  const double neg_inf = -std::numeric_limits<double>::infinity();

  parallel_for(
      nq,
      [&](int64_t qi) {
        // Slots of the path root -> node, in root -> leaf order.
        std::vector<int> path_nodes;
        for (int n = tree.query_node[qi]; n >= 0; n = tree.parent[n]) path_nodes.push_back(n);
        std::vector<int32_t> path;
        for (auto it = path_nodes.rbegin(); it != path_nodes.rend(); ++it) {
          auto s = tree.node_slots(*it);
          path.insert(path.end(), s.begin(), s.end());
        }
        std::vector<double> score(path.size());
        std::vector<double> acc(static_cast<size_t>(d));
        for (int64_t h = 0; h < hq; ++h) {
          const int64_t kvh = h / g;
          const float* qrow = q.data() + (qi * hq + h) * d;
          float* orow = out.data() + (qi * hq + h) * d;
          if (path.empty()) {
            std::fill(orow, orow + d, 0.0f);
            if (!lse.empty()) lse[qi * hq + h] = -std::numeric_limits<float>::infinity();
            continue;
          }
          double m = neg_inf;
          for (size_t j = 0; j < path.size(); ++j) {
            const float* krow = k.data() + (static_cast<int64_t>(path[j]) * hkv + kvh) * d;
            double dot = 0.0;
            for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(qrow[c]) * krow[c];
            score[j] = dot * scale;
            m = std::max(m, score[j]);
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          double sum = 0.0;
          for (size_t j = 0; j < path.size(); ++j) {
            const double p = std::exp(score[j] - m);
            sum += p;
            const float* vrow = v.data() + (static_cast<int64_t>(path[j]) * hkv + kvh) * d;
            for (int64_t c = 0; c < d; ++c) acc[c] += p * vrow[c];
          }
          for (int64_t c = 0; c < d; ++c) orow[c] = static_cast<float>(acc[c] / sum);
          if (!lse.empty()) lse[qi * hq + h] = static_cast<float>(m + std::log(sum));
        }
      },
      num_threads);
}

}  // namespace fasttree
