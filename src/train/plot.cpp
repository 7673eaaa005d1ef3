// SVG loss curves (plot.h).
#include "train/plot.h"

#include "core/check.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

namespace fourbit::train {

namespace {

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

std::string xml_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string tick_label(double v, double step) {
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e5 || a < 1e-3) return fmt::format("{:.1e}", v);
  const int decimals = step >= 1 ? 0 : (int)std::ceil(-std::log10(step) - 1e-9);
  return fmt::format("{:.{}f}", v, decimals);
}

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    if (!std::isfinite(v)) return;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return !(lo <= hi); }
};

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int target) {
  FOURBIT_CHECK(std::isfinite(lo) && std::isfinite(hi) && lo <= hi && target >= 2,
                "nice_ticks: need finite lo <= hi and target >= 2, got {} {} {}", lo, hi, target);
  if (hi == lo) {
    const double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  // The smallest 1/2/5 x 10^k step whose covering ticks number at most target + 1.
  const double raw = (hi - lo) / (target - 1);
  double mag = std::pow(10.0, std::floor(std::log10(raw)) - 1);
  double step = 0;
  for (int i = 0; step == 0 && i < 8; ++i, mag *= 10) {
    for (double m : {1.0, 2.0, 5.0}) {
      const double cand = m * mag;
      const double n = std::ceil(hi / cand - 1e-9) - std::floor(lo / cand + 1e-9) + 1;
      if (n <= target + 1) {
        step = cand;
        break;
      }
    }
  }
  std::vector<double> ticks;
  const int64_t first = (int64_t)std::floor(lo / step + 1e-9), last = (int64_t)std::ceil(hi / step - 1e-9);
  for (int64_t k = first; k <= last; ++k) ticks.push_back(k == 0 ? 0.0 : (double)k * step);
  return ticks;
}

PlotPanels rl_panels() {
  PlotPanels p;
  p.left = "mean reward";
  p.right = "K3 divergence (trainer vs sampler)";
  p.left_axis = "reward";
  p.right_axis = "K3";
  return p;
}

LossSeries read_loss_series(const std::string& path_in) {
  std::string path = path_in;
  if (std::filesystem::is_directory(path)) {
    path = std::filesystem::exists(path + "/metrics.jsonl") || !std::filesystem::exists(path + "/rl_metrics.jsonl")
               ? path + "/metrics.jsonl"
               : path + "/rl_metrics.jsonl";
  }
  std::ifstream in(path);
  FOURBIT_CHECK(in.good(), "plot: cannot read '{}' (give metrics.jsonl / rl_metrics.jsonl files or run "
                "directories written by `fourbit pretrain` or `fourbit rl`)", path);
  LossSeries s;
  std::string line;
  int64_t number = 0;
  bool seen_pretrain_line = false;
  const auto value = [](const nlohmann::json& j, const char* key) {
    return j.contains(key) && j[key].is_number() ? j[key].get<double>()
                                                 : std::numeric_limits<double>::quiet_NaN();
  };
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      throw Error(fmt::format("plot: '{}' line {} is not JSON: {}", path, number, e.what()));
    }
    if (j.is_object() && !j.contains("type") && j.contains("reward_mean")) {  // an RL step
      FOURBIT_CHECK(!seen_pretrain_line,
                    "plot: '{}' line {} is an RL step in a pretraining metrics file", path, number);
      FOURBIT_CHECK(j.contains("step") && j["step"].is_number(),
                    "plot: '{}' line {}: an RL step without a numeric \"step\"", path, number);
      s.kind = MetricsKind::kRl;
      s.train.emplace_back(j["step"].get<double>(), value(j, "reward_mean"));
      s.val.emplace_back(j["step"].get<double>(), value(j, "k3"));
      continue;
    }
    FOURBIT_CHECK(j.is_object() && j.contains("type") && s.kind == MetricsKind::kPretrain,
                  "plot: '{}' line {} has no \"type\" (not a fourbit metrics file?)", path, number);
    const std::string type = j["type"].get<std::string>();
    seen_pretrain_line = true;
    if (type == "run") {
      if (j.contains("recipe") && j["recipe"].is_string()) s.label = j["recipe"].get<std::string>();
    } else if (type == "train" || type == "eval") {
      FOURBIT_CHECK(j.contains("step") && j["step"].is_number(),
                    "plot: '{}' line {}: a {} line without a numeric \"step\"", path, number, type);
      const double step = j["step"].get<double>();
      if (type == "train") {
        s.train.emplace_back(step, value(j, "loss"));
      } else {
        s.val.emplace_back(step, value(j, "val_loss"));
      }
    }
  }
  if (s.label.empty()) {
    s.label = std::filesystem::path(path).parent_path().filename().string();
    if (s.label.empty()) s.label = path;
  }
  return s;
}

std::string render_loss_svg(const std::vector<LossSeries>& series_in, const PlotOptions& o) {
  FOURBIT_CHECK(!series_in.empty(), "plot: no runs to plot");
  FOURBIT_CHECK(o.smooth >= 0 && o.smooth < 1, "plot: --smooth must lie in [0, 1), got {}",
                o.smooth);
  FOURBIT_CHECK(o.width >= 300 && o.height >= 200, "plot: the image must be at least 300 x 200");
  std::vector<LossSeries> series = series_in;
  if (o.smooth > 0) {
    for (LossSeries& s : series) {
      double ema = std::numeric_limits<double>::quiet_NaN();
      for (auto& [x, y] : s.train) {
        if (!std::isfinite(y)) continue;
        ema = std::isfinite(ema) ? o.smooth * ema + (1 - o.smooth) * y : y;
        y = ema;
      }
    }
  }
  const double W = o.width, H = o.height;
  const double legend_h = 22.0 * (double)((series.size() + 3) / 4) + 8;
  const double top = 40, bottom = 48 + legend_h, left = 64, right = 16, gap = 56;
  const double panel_w = (W - left - right - gap - left) / 2;  // each panel has its own left axis
  const double panel_h = H - top - bottom;

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} "
      "{1}\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect x=\"0\" y=\"0\" width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"22\" text-anchor=\"middle\" font-size=\"16\">{3}</text>\n",
      o.width, o.height, W / 2, xml_escape(o.title));

  for (int panel = 0; panel < 2; ++panel) {
    const bool train = panel == 0;
    const double x0 = left + panel * (panel_w + gap + left), y0 = top;
    Range xr, yr;
    for (const LossSeries& s : series) {
      for (const auto& [x, y] : train ? s.train : s.val) {
        if (!std::isfinite(y)) continue;
        xr.add(x);
        yr.add(y);
      }
    }
    svg += fmt::format("<g class=\"panel\" id=\"{}\">\n", train ? "train" : "val");
    svg += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
                       "fill=\"none\" stroke=\"#333\"/>\n",
                       x0, y0, panel_w, panel_h);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" font-size=\"14\">{}"
                       "</text>\n",
                       x0 + panel_w / 2, y0 - 6, xml_escape(train ? o.panels.left : o.panels.right));
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">step</text>\n",
                       x0 + panel_w / 2, y0 + panel_h + 36);
    if (xr.empty()) {
      svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" fill=\"#888\">no "
                         "data</text>\n</g>\n",
                         x0 + panel_w / 2, y0 + panel_h / 2);
      continue;
    }
    const std::vector<double> xt = nice_ticks(xr.lo, xr.hi, 6), yt = nice_ticks(yr.lo, yr.hi, 6);
    const double xlo = std::min(xt.front(), xr.lo), xhi = std::max(xt.back(), xr.hi);
    const double ylo = std::min(yt.front(), yr.lo), yhi = std::max(yt.back(), yr.hi);
    const auto px = [&](double x) { return x0 + (xhi == xlo ? 0.5 : (x - xlo) / (xhi - xlo)) * panel_w; };
    const auto py = [&](double y) {
      return y0 + panel_h - (yhi == ylo ? 0.5 : (y - ylo) / (yhi - ylo)) * panel_h;
    };
    const double xstep = xt.size() > 1 ? xt[1] - xt[0] : 1, ystep = yt.size() > 1 ? yt[1] - yt[0] : 1;
    for (double t : xt) {
      svg += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" "
                         "stroke=\"#ddd\"/><line x1=\"{0:.1f}\" y1=\"{2:.1f}\" x2=\"{0:.1f}\" "
                         "y2=\"{3:.1f}\" stroke=\"#333\"/><text x=\"{0:.1f}\" y=\"{4:.1f}\" "
                         "text-anchor=\"middle\">{5}</text>\n",
                         px(t), y0, y0 + panel_h, y0 + panel_h + 5, y0 + panel_h + 18,
                         tick_label(t, xstep));
    }
    for (double t : yt) {
      svg += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" "
                         "stroke=\"#ddd\"/><line x1=\"{3:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" "
                         "y2=\"{1:.1f}\" stroke=\"#333\"/><text x=\"{4:.1f}\" y=\"{5:.1f}\" "
                         "text-anchor=\"end\">{6}</text>\n",
                         x0, py(t), x0 + panel_w, x0 - 5, x0 - 8, py(t) + 4, tick_label(t, ystep));
    }
    svg += fmt::format("<text x=\"{0:.1f}\" y=\"{1:.1f}\" text-anchor=\"middle\" "
                       "transform=\"rotate(-90 {0:.1f} {1:.1f})\">{2}</text>\n",
                       x0 - 48, y0 + panel_h / 2, xml_escape(train ? o.panels.left_axis : o.panels.right_axis));
    for (size_t i = 0; i < series.size(); ++i) {
      const char* color = kColors[i % std::size(kColors)];
      const auto& pts = train ? series[i].train : series[i].val;
      // One polyline per stretch of finite points (skipped steps break the line); a lone point
      // is a dot.
      std::vector<std::pair<double, double>> stretch;
      const auto flush = [&] {
        if (stretch.size() == 1) {
          svg += fmt::format("<circle class=\"series-{}\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" "
                             "fill=\"{}\"/>\n",
                             i, stretch[0].first, stretch[0].second, color);
        } else if (stretch.size() > 1) {
          std::string points;
          for (const auto& [x, y] : stretch)
            points += fmt::format("{}{:.1f},{:.1f}", points.empty() ? "" : " ", x, y);
          svg += fmt::format("<polyline class=\"series-{}\" fill=\"none\" stroke=\"{}\" "
                             "stroke-width=\"1.5\" points=\"{}\"/>\n",
                             i, color, points);
        }
        stretch.clear();
      };
      for (const auto& [x, y] : pts) {
        if (std::isfinite(y)) {
          stretch.emplace_back(px(x), py(y));
        } else {
          flush();
        }
      }
      flush();
    }
    svg += "</g>\n";
  }
  // Legend below the panels, four entries per row.
  const double ly = H - legend_h + 6;
  for (size_t i = 0; i < series.size(); ++i) {
    const double lx = left + (double)(i % 4) * (W - left - right) / 4;
    const double row = ly + 22.0 * (double)(i / 4);
    svg += fmt::format("<g class=\"legend\"><line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" "
                       "y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"3\"/><text x=\"{:.1f}\" "
                       "y=\"{:.1f}\">{}</text></g>\n",
                       lx, row, lx + 24, row, kColors[i % std::size(kColors)], lx + 30, row + 4,
                       xml_escape(series[i].label));
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace fourbit::train
