// quant: the quant-report table on a small tensor (what `fourbit run` prints today).
#include "quant/report.h"

#include <gtest/gtest.h>

#include <map>

namespace fourbit::quant {
namespace {

TEST(QuantReport, CoversEveryCaseAndOrdersFormatsByPrecision) {
  ReportOptions o;
  o.rows = 128;
  o.cols = 256;
  const std::vector<ReportRow> rows = run_quant_report(o);
  EXPECT_EQ(rows.size(), 3 * default_report_cases().size());
  std::map<std::string, ErrorStats> normal;
  for (const ReportRow& r : rows) {
    EXPECT_GT(r.stats.relative_error, 0.0) << r.case_name;
    if (r.distribution == "normal") normal[r.case_name] = r.stats;
  }
  EXPECT_LT(normal["bf16"].relative_error, normal["mxfp8"].relative_error);
  EXPECT_LT(normal["mxfp8"].relative_error, normal["nvfp4"].relative_error);
  EXPECT_LT(normal["nvfp4 4/6"].relative_error, normal["nvfp4"].relative_error);
  // SR trades error for bias: larger error, smaller |bias| than round-to-nearest.
  EXPECT_GT(normal["nvfp4 sr"].relative_error, normal["nvfp4"].relative_error);
  EXPECT_LT(std::fabs(normal["nvfp4 sr 16/17"].relative_bias), std::fabs(normal["nvfp4"].relative_bias));
  const std::string table = format_report_table(rows);
  EXPECT_NE(table.find("nvfp4 1x16 sr rht"), std::string::npos) << table;
}

}  // namespace
}  // namespace fourbit::quant
