// train/plot.h and train/compare.h: nice tick values; the SVG of two runs is well-formed (every
// tag closed in order, one root <svg>), has both panels, a line per run and panel, axis ticks and
// the legend labels (escaped); skipped steps break a line; malformed metrics files are refused
// naming file and line; RL metrics (reward and K3 panels); the comparison table's gap column.
#include "train/compare.h"
#include "train/plot.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>

namespace fourbit::train {
namespace {

namespace fs = std::filesystem;

TEST(Plot, NiceTicks) {
  EXPECT_EQ(nice_ticks(0, 10, 6), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(nice_ticks(1, 150, 6), (std::vector<double>{0, 50, 100, 150}));
  EXPECT_EQ(nice_ticks(2.63, 5.95, 6), (std::vector<double>{2, 3, 4, 5, 6}));
  const std::vector<double> t = nice_ticks(2.63, 5.95, 10);
  ASSERT_EQ(t.size(), 8u);
  EXPECT_NEAR(t[1] - t[0], 0.5, 1e-12);
  EXPECT_DOUBLE_EQ(t.front(), 2.5);
  EXPECT_DOUBLE_EQ(t.back(), 6.0);
  const std::vector<double> u = nice_ticks(0, 1200, 6);
  EXPECT_EQ(u, (std::vector<double>{0, 200, 400, 600, 800, 1000, 1200}));
}

// Checks that tags nest properly: returns the number of elements, fails the test otherwise.
int check_well_formed(const std::string& svg) {
  std::vector<std::string> stack;
  int elements = 0;
  size_t i = 0;
  while ((i = svg.find('<', i)) != std::string::npos) {
    const size_t end = svg.find('>', i);
    EXPECT_NE(end, std::string::npos);
    if (end == std::string::npos) return -1;
    const std::string tag = svg.substr(i + 1, end - i - 1);
    EXPECT_EQ(tag.find('<'), std::string::npos) << tag;
    // Attribute values must be quoted in pairs.
    EXPECT_EQ(std::count(tag.begin(), tag.end(), '"') % 2, 0) << tag;
    if (tag[0] == '/') {
      EXPECT_FALSE(stack.empty()) << tag;
      if (stack.empty()) return -1;
      EXPECT_EQ(stack.back(), tag.substr(1));
      stack.pop_back();
    } else {
      ++elements;
      const std::string name = tag.substr(0, tag.find_first_of(" />"));
      if (tag.back() != '/') stack.push_back(name);
      if (elements == 1) EXPECT_EQ(name, "svg");
      else EXPECT_FALSE(stack.empty() || stack.front() != "svg") << "element outside <svg>";
    }
    i = end + 1;
  }
  EXPECT_TRUE(stack.empty()) << "unclosed: " << (stack.empty() ? "" : stack.back());
  return elements;
}

int count(const std::string& s, const std::string& needle) {
  int n = 0;
  for (size_t i = s.find(needle); i != std::string::npos; i = s.find(needle, i + 1)) ++n;
  return n;
}

TEST(Plot, SvgIsWellFormed) {
  const std::string dir = (fs::temp_directory_path() / fmt::format("fourbit_plot_{}", ::getpid())).string();
  fs::create_directories(dir + "/a");
  fs::create_directories(dir + "/b");
  {
    std::ofstream a(dir + "/a/metrics.jsonl");
    a << R"({"type":"run","recipe":"bf16"})" << "\n";
    for (int s = 1; s <= 20; ++s)
      a << fmt::format(R"({{"type":"train","step":{},"loss":{}}})", s, 6.0 - 0.1 * s) << "\n";
    a << R"({"type":"eval","step":10,"val_loss":5.1})" << "\n"
      << R"({"type":"eval","step":20,"val_loss":4.2})" << "\n";
    std::ofstream b(dir + "/b/metrics.jsonl");
    b << R"({"type":"run","recipe":"e2e4 <x&y>"})" << "\n";
    for (int s = 1; s <= 20; ++s) {
      if (s == 7) b << R"({"type":"train","step":7,"loss":null,"skipped":true})" << "\n";
      else b << fmt::format(R"({{"type":"train","step":{},"loss":{}}})", s, 6.1 - 0.1 * s) << "\n";
    }
    b << R"({"type":"eval","step":20,"val_loss":4.3})" << "\n";
  }
  std::vector<LossSeries> series = {read_loss_series(dir + "/a/metrics.jsonl"),
                                    read_loss_series(dir + "/b")};
  EXPECT_EQ(series[0].label, "bf16");
  EXPECT_EQ(series[0].train.size(), 20u);
  EXPECT_TRUE(std::isnan(series[1].train[6].second));
  const std::string svg = render_loss_svg(series);
  EXPECT_GT(check_well_formed(svg), 30);
  EXPECT_EQ(count(svg, "class=\"panel\""), 2);
  EXPECT_NE(svg.find("training loss"), std::string::npos);
  EXPECT_NE(svg.find("validation loss"), std::string::npos);
  // Train: run a is one line, run b two (the skipped step breaks it). Val: a one line, b a dot.
  EXPECT_EQ(count(svg, "<polyline class=\"series-0\""), 2);
  EXPECT_EQ(count(svg, "<polyline class=\"series-1\""), 2);
  EXPECT_EQ(count(svg, "<circle class=\"series-1\""), 1);
  EXPECT_NE(svg.find(">bf16</text>"), std::string::npos);
  EXPECT_NE(svg.find(">e2e4 &lt;x&amp;y&gt;</text>"), std::string::npos);
  EXPECT_NE(svg.find(">20</text>"), std::string::npos);  // an x tick
  // Every coordinate lies inside the image.
  const std::regex num_re("(x|y|x1|x2|y1|y2|cx|cy)=\"(-?[0-9.]+)\"");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), num_re); it != std::sregex_iterator(); ++it) {
    const double v = std::stod((*it)[2]);
    EXPECT_GE(v, 0);
    EXPECT_LE(v, 1000);
  }

  std::ofstream(dir + "/bad.jsonl") << R"({"type":"train","step":1,"loss":2})" << "\nnot json\n";
  try {
    read_loss_series(dir + "/bad.jsonl");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_loss_series(dir + "/missing.jsonl"), Error);
  fs::remove_all(dir);
}

// RL runs: rl_metrics.jsonl (no "type", one object per step) gives (step, reward) and (step, K3);
// a directory holding only rl_metrics.jsonl is read; the RL panel titles reach the SVG; an RL line
// inside a pretraining file is refused.
TEST(Plot, RlMetrics) {
  const std::string dir = (fs::temp_directory_path() / fmt::format("fourbit_plot_rl_{}", ::getpid())).string();
  fs::create_directories(dir + "/nvfp4");
  {
    std::ofstream f(dir + "/nvfp4/rl_metrics.jsonl");
    for (int s = 1; s <= 8; ++s)
      f << fmt::format(R"({{"step":{},"reward_mean":{},"k3":{},"entropy":1.5}})", s, 0.1 * s, 1e-3 * s) << "\n";
  }
  const LossSeries r = read_loss_series(dir + "/nvfp4");
  EXPECT_EQ(r.kind, MetricsKind::kRl);
  EXPECT_EQ(r.label, "nvfp4");
  ASSERT_EQ(r.train.size(), 8u);
  ASSERT_EQ(r.val.size(), 8u);
  EXPECT_DOUBLE_EQ(r.train[2].first, 3);
  EXPECT_DOUBLE_EQ(r.train[2].second, 0.3);
  EXPECT_DOUBLE_EQ(r.val[7].second, 8e-3);
  PlotOptions o;
  o.panels = rl_panels();
  const std::string svg = render_loss_svg({r}, o);
  EXPECT_GT(check_well_formed(svg), 20);
  EXPECT_NE(svg.find(">mean reward</text>"), std::string::npos);
  EXPECT_NE(svg.find(">K3 divergence (trainer vs sampler)</text>"), std::string::npos);
  EXPECT_EQ(svg.find("training loss"), std::string::npos);

  std::ofstream(dir + "/mixed.jsonl") << R"({"type":"train","step":1,"loss":2})" << "\n"
                                      << R"({"step":2,"reward_mean":0.5,"k3":0.1})" << "\n";
  try {
    read_loss_series(dir + "/mixed.jsonl");
    FAIL() << "an RL line in a pretraining file was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(Compare, TableGaps) {
  RecipeRun a, b;
  a.recipe = "bf16";
  a.summary.steps = b.summary.steps = 10;
  a.summary.final_train_loss = 2.0;
  a.summary.final_val_loss = 2.5;
  b.recipe = "path/to/my-recipe.json";
  b.summary.final_train_loss = 2.1;
  b.summary.final_val_loss = 2.45;
  const std::string t = comparison_table({a, b});
  EXPECT_NE(t.find("my-recipe"), std::string::npos) << t;
  EXPECT_NE(t.find("+5.00%"), std::string::npos) << t;
  EXPECT_NE(t.find("-2.00%"), std::string::npos) << t;
  EXPECT_NE(t.find("(base)"), std::string::npos) << t;
}

}  // namespace
}  // namespace fourbit::train
