// Layer profiles (coordinator/exegpt/layer_profile.h, profiler.h): interpolation worked by hand,
// the roofline a node model gives, JSON that round-trips and refuses what is not a profile, and the
// profiler's conversion of stage reports -- grids per layer, the embedding and head carried to
// every rank, the link as the least-squares line of the transfers.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "coordinator/exegpt/layer_profile.h"
#include "coordinator/exegpt/profiler.h"
#include "kernels/error.h"
#include "support/test_device.h"

namespace strata {
namespace {

TEST(TimeGrid, BilinearInsideLinearOutside) {
  // t(x, y) = x + 10 y on the corners of [0, 2] x [0, 1]: exact everywhere (it is linear).
  const TimeGrid g({0, 2}, {0, 1}, {0, 10, 2, 12});
  bool out = false;
  EXPECT_DOUBLE_EQ(g.at(1, 0.5, &out), 6);
  EXPECT_FALSE(out);
  EXPECT_DOUBLE_EQ(g.at(4, 1, &out), 14);  // extrapolated along x
  EXPECT_TRUE(out);
  // A curve: 1 at 1, 3 at 3; at 2 it is 2, beyond it keeps the slope, never below 0.
  const TimeGrid c = TimeGrid::curve({1, 3}, {1, 3});
  EXPECT_DOUBLE_EQ(c.at(2), 2);
  EXPECT_DOUBLE_EQ(c.at(5), 5);
  EXPECT_DOUBLE_EQ(c.at(-10), 0);
  EXPECT_THROW(TimeGrid({2, 1}, {0}, {1, 1}), InputError);   // not ascending
  EXPECT_THROW(TimeGrid({1, 2}, {0}, {1}), InputError);      // one time for two points
  EXPECT_THROW(TimeGrid({1, 2}, {0}, {1, -1}), InputError);  // negative
}

TEST(ModelledProfile, RooflineByHand) {
  // One layer with q, k, v, o of 10 x 10 and two RMSNorm weights of 10: 420 parameters, in
  // 2-byte weights; a node of 1e6 FLOP/s and 1e4 B/s, no overhead. A decode step of one
  // sequence at context 1: 2 * 420 + 4 * 10 = 880 FLOPs (0.88 ms) against 840 bytes of
  // weights + 80 of f32 K and V (92 ms): 0.092 s. A prefill of 2 rows of length 2:
  // 2 * 420 * 2 + 2 * 2 * 2 * 10 = 1760 FLOPs against 840 + 2 * 80 * 2 = 1160 bytes: 0.116 s.
  ModelShape s;
  s.hidden = 10;
  s.n_layers = 1;
  s.n_heads = 1;
  s.n_kv_heads = 1;
  s.head_dim = 10;
  s.vocab = 10;
  s.weight_bytes_per_elem = 2;
  ASSERT_EQ(s.params_per_layer(), 420);
  NodeModel n{"hand", 1e6, 1e4, 1e9, 1e9, 0, 0, true};
  ProfileGrid g;
  g.prefill_rows = g.prefill_lengths = g.decode_seqs = g.decode_contexts = {1, 2};
  g.embed_rows = g.head_rows = {1, 2};
  const ClusterProfile p = modelled_profile(s, "hand", n, 2, g);
  ASSERT_EQ(p.workers(), 2);
  EXPECT_DOUBLE_EQ(p.ranks[0].decode.at(1, 1), 0.092);
  EXPECT_DOUBLE_EQ(p.ranks[1].prefill.at(2, 2), 0.116);
  EXPECT_TRUE(p.modelled);
}

// The host worker `strata plan` models this machine as: its measured rates, 16 GiB, and
// Open MPI's shared-memory link (ENVIRONMENT.md: 5-6 GB/s).
TEST(NodeModel, HostWorkerIsTheNamedDescription) {
  const NodeModel n = NodeModel::host_worker("this machine", 2e11, 3e10);
  EXPECT_EQ(n.name, "this machine");
  EXPECT_EQ(n.flops, 2e11);
  EXPECT_EQ(n.memory_bandwidth, 3e10);
  EXPECT_EQ(n.memory_bytes, 16.0 * 1024 * 1024 * 1024);
  EXPECT_EQ(n.link_bandwidth, 5e9);
  EXPECT_EQ(n.link_latency_s, 20e-6);
  EXPECT_EQ(n.layer_overhead_s, 50e-6);
  EXPECT_FALSE(n.device);
  const NodeModel back = NodeModel::from_json(n.to_json(), "round trip");
  EXPECT_EQ(back.to_json(), n.to_json());
}

// A run's profile key: the policy's text, or "budgets" without one.
TEST(Profiler, KeyNamesThePlacement) {
  const ProfileKey budgets = profile_key("dummy:opt-125m", DType::kF16, std::nullopt, {"h1", "h2"});
  EXPECT_EQ(budgets.model, "dummy:opt-125m");
  EXPECT_EQ(budgets.dtype, "f16");
  EXPECT_EQ(budgets.placement, "budgets");
  EXPECT_EQ(budgets.hosts, (std::vector<std::string>{"h1", "h2"}));
  const Policy policy = Policy::parse("w=100/0/0,c=100/0/0");
  EXPECT_EQ(profile_key("m", DType::kF32, policy, {}).placement, policy.str());
}

TEST(ClusterProfile, JsonRoundTripsAndErrorsNameTheField) {
  const std::string dir = testing::test_tmp_dir("layer_profile");
  ProfileGrid g = ProfileGrid::for_limits(64, 8, 128);
  const ClusterProfile p = modelled_profile(ModelShape{768, 3072, 12, 12, 12, 64, 50272, 2048}, "m",
                                            NodeModel::preset("a40"), 3, g);
  p.save(dir + "/p.json");
  const ClusterProfile back = ClusterProfile::load(dir + "/p.json");
  EXPECT_EQ(back.key(), p.key());
  EXPECT_DOUBLE_EQ(back.ranks[2].decode.at(8, 128), p.ranks[2].decode.at(8, 128));
  nlohmann::json j = p.to_json();
  j["ranks"][1].erase("decode");
  try {
    ClusterProfile::from_json(j, "x.json");
    FAIL() << "a rank without decode times accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("x.json: ranks[1]: missing field 'decode'"),
              std::string::npos)
        << e.what();
  }
}

TEST(Profiler, ReportsBecomePerLayerGridsAndALink) {
  ProfileGrid g;
  g.prefill_rows = {16, 64};
  g.prefill_lengths = {16, 32};
  g.decode_seqs = {1, 4};
  g.decode_contexts = {16, 32};
  g.embed_rows = {1, 64};
  g.head_rows = {1, 4};
  const ProfileRequest req = profile_request(g, 64, 3);
  EXPECT_EQ(req.transfer_rows, (std::vector<int32_t>{1, 16, 64}));
  ProfileResult r;
  r.round_trip_s = 2e-4;
  ProfileReport first{1, "h1", 3, {1, 2, 3, 4}, {5, 6, 7, 8}, {0.1, 0.2}, {}, {}};
  // Transfers of 1, 16, 64 rows of hidden 8 (32, 512, 2048 bytes) in 1e-5 + 1e-8 s/B.
  for (double bytes : {32.0, 512.0, 2048.0}) first.transfer_seconds.push_back(1e-5 + 1e-8 * bytes);
  ProfileReport last{2, "h2", 2, {9, 10, 11, 12}, {13, 14, 15, 16}, {}, {0.3, 0.4}, {}};
  r.reports = {first, last};
  const ClusterProfile p =
      cluster_profile(ProfileKey{"m", "f32", "budgets", {"h1", "h2"}}, g, req, r, 8);
  EXPECT_DOUBLE_EQ(p.ranks[0].prefill.at(64, 16), 3);  // row-major over rows x lengths
  EXPECT_DOUBLE_EQ(p.ranks[1].decode.at(4, 32), 16);
  EXPECT_DOUBLE_EQ(p.ranks[1].embed.at(64), 0.2) << "the first rank's embedding, carried";
  EXPECT_DOUBLE_EQ(p.ranks[0].head.at(4), 0.4) << "the last rank's head, carried";
  EXPECT_NEAR(p.link.latency_s, 1e-5, 1e-12);
  EXPECT_NEAR(p.link.seconds_per_byte, 1e-8, 1e-15);
  EXPECT_DOUBLE_EQ(p.step_overhead_s, 2e-4);
  EXPECT_EQ(p.key(), "m|f32|budgets|h1,h2");
  ProfileResult short_report = r;
  short_report.reports[1].decode_seconds.pop_back();
  EXPECT_THROW(cluster_profile(ProfileKey{"m", "f32", "budgets", {}}, g, req, short_report, 8),
               Error);
}

}  // namespace
}  // namespace strata
