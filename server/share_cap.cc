#include "server/share_cap.h"

#include <algorithm>
#include <map>

namespace dmuon::server {
namespace {

struct Group {
  double weight = 0;  // W_p
  double cap = 1;     // c_p
  double share = -1;  // s_p once fixed; -1 while it follows its weight
};

// Fixes the share of every principal whose claim exceeds its cap, until
// none does (each pass only raises the others' claims, see share_cap.h);
// then gives what is left to the unfixed ones by weight, or, when every
// principal is held at its cap, to all of them by cap.
void WaterFill(std::map<std::string, Group>& groups) {
  double left = 1;
  for (bool fixed = true; fixed;) {
    fixed = false;
    double free_weight = 0;
    for (const auto& [name, g] : groups)
      if (g.share < 0) free_weight += g.weight;
    if (free_weight <= 0) break;
    double took = 0;
    for (auto& [name, g] : groups) {
      if (g.share >= 0 || left * g.weight / free_weight <= g.cap) continue;
      g.share = g.cap;
      took += g.cap;
      fixed = true;
    }
    left -= took;
  }
  double free_weight = 0, caps = 0;
  for (const auto& [name, g] : groups) {
    if (g.share < 0) free_weight += g.weight;
    caps += g.cap;
  }
  for (auto& [name, g] : groups) {
    if (free_weight > 0) {
      if (g.share < 0) g.share = left * g.weight / free_weight;
    } else {
      g.share = g.cap / caps;  // every cap reached: work-conserving
    }
  }
}

}  // namespace

std::vector<double> CappedWeights(const std::vector<ShareClaim>& claims) {
  static const std::string kAnonymous;
  std::map<std::string, Group> groups;
  double total = 0;
  for (const ShareClaim& c : claims) {
    Group& g = groups[c.principal ? *c.principal : kAnonymous];
    g.weight += c.weight;
    g.cap = std::min(g.cap, std::clamp(c.max_share, 1e-6, 1.0));
    total += c.weight;
  }
  std::vector<double> out;
  out.reserve(claims.size());
  if (groups.size() < 2) {
    for (const ShareClaim& c : claims) out.push_back(c.weight);
    return out;
  }
  WaterFill(groups);
  for (const ShareClaim& c : claims) {
    const Group& g = groups[c.principal ? *c.principal : kAnonymous];
    out.push_back(c.weight * g.share * total / g.weight);
  }
  return out;
}

}  // namespace dmuon::server
