// libfourbit_ktrace.so: a kernel-time summary for any CUDA program, by LD_PRELOAD, for machines
// without Nsight Systems (the device machines have none that works; ncu profiles one launch at a
// time). It records every kernel and memcpy/memset with the CUPTI activity API (start/end
// timestamps from the GPU) and, when the program exits, prints one table: per kernel name (template
// arguments kept, shortened), the launch count, total and mean time, and share of all kernel time,
// sorted by total; then the GPU's idle time between activities (gaps under 1 ms, the steady
// state's launch and synchronization losses, by the activity that ended them; longer gaps apart),
// and the busy time each kernel adds to the timeline beyond the kernels before it (the table to
// read for PDL-launched chains such as the decode step, whose kernels start early and wait).
//
//   LD_PRELOAD=build-gpu/tools/ktrace/libfourbit_ktrace.so fourbit bench train --presets gpt2-124m --recipes nvfp4
//   CUDA_INJECTION64_PATH=build-gpu/tools/ktrace/libfourbit_ktrace.so fourbit ...   (the same, loaded by the
//                                        driver at cuInit: CUPTI's injection, where LD_PRELOAD records nothing)
//
// Environment: FOURBIT_KTRACE_OUT=file writes the table there (default: stderr);
// FOURBIT_KTRACE_TOP=n keeps the n largest rows (default 60); FOURBIT_KTRACE_WIDTH=n cuts names
// to n characters (default 110); FOURBIT_KTRACE_SERIAL=1 records CUPTI_ACTIVITY_KIND_KERNEL (serializes
// kernels) instead of the concurrent kind.
// Invariants: the times are GPU durations of each launch (end - start), summed; kernels that ran
// concurrently are both counted in full, so the total can exceed wall time. CUPTI adds a little
// time per launch; compare shares, not absolute times, against untraced runs.
// When: the table is written by an atexit handler registered at CUPTI's first buffer request,
// which is meant to come with the first recorded activity, after the CUDA runtime registered its
// own exit handlers, so that it runs (exit handlers go last-registered first) while the contexts
// still exist; the library's destructor writes it only if that never ran. (Session 24 saw an
// empty table from the destructor alone, on an H100 with driver 580; the cause was not
// established.) The table's first line counts the activity buffers CUPTI asked for and returned,
// so an empty table says whether any records came at all.
#include <cupti.h>

#include <cxxabi.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Row {
  long long count = 0;
  double total_ns = 0;
};

// One GPU activity's interval, for the idle-gap summary; `name` points at its g_rows key (map
// nodes do not move).
struct Interval {
  unsigned long long start, end;
  const std::string* name;
};
constexpr size_t kMaxIntervals = size_t{4} << 20;  // 96 MiB at most; later activities are not kept

std::mutex g_mutex;
std::map<std::string, Row>* g_rows = nullptr;  // leaked on purpose: used from CUPTI's threads at exit
std::vector<Interval>* g_intervals = nullptr;
bool g_ok = false;
std::atomic<bool> g_reported{false};
std::atomic<long> g_buffers_requested{0}, g_buffers_completed{0};
std::atomic<long> g_contexts_seen{0}, g_runtime_api_calls{0};
CUptiResult g_subscribe_result = CUPTI_SUCCESS;
CUpti_SubscriberHandle g_subscriber = nullptr;
std::once_flag g_atexit_once;
void report();

constexpr size_t kBufferBytes = 8 << 20;

std::string short_name(const char* mangled) {
  if (mangled == nullptr) return "(unnamed)";
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d != nullptr ? d : mangled;
  std::free(d);
  // Drop the namespaces and the argument list; keep the template arguments.
  for (const char* ns : {"fourbit::", "(anonymous namespace)::", "kernels::"}) {
    for (size_t p; (p = s.find(ns)) != std::string::npos;) s.erase(p, std::strlen(ns));
  }
  int depth = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') ++depth;
    if (s[i] == '>') --depth;
    if (s[i] == '(' && depth == 0) {
      s.resize(i);
      break;
    }
  }
  return s;
}

void add(const std::string& name, unsigned long long start, unsigned long long end) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_rows->try_emplace(name).first;
  it->second.count += 1;
  it->second.total_ns += (double)(end - start);
  if (g_intervals->size() < kMaxIntervals) g_intervals->push_back({start, end, &it->first});
}

// The GPU's idle time between activities: the intervals sorted by start, a gap wherever one starts
// after every earlier one has ended. Gaps of 1 ms or more are counted apart (set-up, host phases
// between benchmark cases); the shorter ones are what a run's steady state loses to launches and
// host synchronizations, listed by the activity that ended each gap.
void report_gaps(FILE* out, std::vector<Interval> v) {
  // CUPTI reports some records without timestamps (start 0): they would open a span from the
  // clock's origin (session 28's traces showed a "GPU span" of 1.8e12 ms).
  const size_t n_all = v.size();
  v.erase(std::remove_if(v.begin(), v.end(), [](const Interval& a) { return a.start == 0 || a.end < a.start; }),
          v.end());
  if (v.size() != n_all) std::fprintf(out, "ktrace: %zu records without timestamps left out of the gaps\n", n_all - v.size());
  if (v.empty()) return;
  std::sort(v.begin(), v.end(), [](const Interval& a, const Interval& b) { return a.start < b.start; });
  unsigned long long covered = v[0].end;
  struct LongGap {
    double at_ms, us;
    const std::string *before, *after;
  };
  std::vector<LongGap> long_gaps;  // gaps of 100 us or more, in time order
  // The busy time each activity adds to the timeline (its end past every earlier activity's end,
  // from where those ended or from its own start), by name: with programmatic dependent launch a
  // kernel starts before its producer ends and waits, so its duration counts that wait, while this
  // counts only the time it keeps the GPU busy beyond the kernels before it.
  std::map<const std::string*, std::pair<double, long>> extends;
  extends[v[0].name].first += (double)(v[0].end - v[0].start);
  extends[v[0].name].second += 1;
  const std::string* last_ended = v[0].name;
  double short_ns = 0, long_ns = 0;
  long short_count = 0, long_count = 0, over_10us = 0;
  std::map<const std::string*, std::pair<double, long>> after;  // gap time and count by next activity
  for (size_t i = 1; i < v.size(); ++i) {
    if (v[i].start > covered) {
      const double gap = (double)(v[i].start - covered);
      if (gap >= 1e5) long_gaps.push_back({(double)(covered - v[0].start) * 1e-6, gap * 1e-3, last_ended, v[i].name});
      if (gap >= 1e6) {
        long_ns += gap;
        ++long_count;
      } else {
        short_ns += gap;
        ++short_count;
        if (gap > 1e4) ++over_10us;
        auto& a = after[v[i].name];
        a.first += gap;
        a.second += 1;
      }
    }
    auto& e = extends[v[i].name];
    e.second += 1;
    if (v[i].end > covered) e.first += (double)(v[i].end - std::max(covered, v[i].start));
    if (v[i].end >= covered) last_ended = v[i].name;
    covered = std::max(covered, v[i].end);
  }
  const double span = (double)(covered - v[0].start);
  std::fprintf(out, "ktrace: GPU span %.3f ms; idle %.3f ms in %ld gaps under 1 ms (%ld over 10 us) and %.3f ms in "
               "%ld gaps of 1 ms or more%s\n", span * 1e-6, short_ns * 1e-6, short_count, over_10us,
               long_ns * 1e-6, long_count,
               v.size() >= kMaxIntervals ? " (interval list full: later activities left out)" : "");
  std::vector<std::pair<const std::string*, std::pair<double, long>>> rows(after.begin(), after.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  std::fprintf(out, "%10s %10s %10s  %s\n", "idle ms", "gaps", "mean us", "the gaps under 1 ms ended by");
  for (size_t i = 0; i < rows.size() && i < 12; ++i) {
    std::fprintf(out, "%10.3f %10ld %10.2f  %s\n", rows[i].second.first * 1e-6, rows[i].second.second,
                 rows[i].second.first * 1e-3 / (double)rows[i].second.second, rows[i].first->c_str());
  }
  std::vector<std::pair<const std::string*, std::pair<double, long>>> ext(extends.begin(), extends.end());
  std::sort(ext.begin(), ext.end(), [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  double busy = 0;
  for (const auto& r : ext) busy += r.second.first;
  std::fprintf(out, "ktrace: busy time added to the timeline by each activity (%.3f ms in all; PDL waits not counted)\n",
               busy * 1e-6);
  std::fprintf(out, "%10s %10s %10s %7s  %s\n", "adds ms", "launches", "mean us", "share", "activity");
  for (size_t i = 0; i < ext.size() && i < 30; ++i) {
    std::fprintf(out, "%10.3f %10ld %10.2f %6.2f%%  %.110s\n", ext[i].second.first * 1e-6, ext[i].second.second,
                 ext[i].second.first * 1e-3 / (double)ext[i].second.second, 100.0 * ext[i].second.first / busy,
                 ext[i].first->c_str());
  }
  // The long gaps one by one (the last 40): in a training benchmark, the step boundaries (host
  // synchronizations and what the host does before the next step's first launch).
  std::fprintf(out, "ktrace: %zu gaps of 100 us or more; the last %zu (at: ms after the first activity):\n",
               long_gaps.size(), std::min<size_t>(long_gaps.size(), 40));
  std::fprintf(out, "%12s %12s  %s\n", "at ms", "gap us", "after -> before");
  for (size_t i = long_gaps.size() > 40 ? long_gaps.size() - 40 : 0; i < long_gaps.size(); ++i) {
    const LongGap& g = long_gaps[i];
    std::fprintf(out, "%12.3f %12.1f  %.60s -> %.60s\n", g.at_ms, g.us, g.before->c_str(), g.after->c_str());
  }
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  std::call_once(g_atexit_once, [] { std::atexit(report); });
  g_buffers_requested.fetch_add(1);
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  g_buffers_completed.fetch_add(1);
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        add(short_name(k->name), k->start, k->end);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        add("[memcpy kind " + std::to_string((int)m->copyKind) + "]", m->start, m->end);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        add("[memset " + std::to_string((unsigned long long)m->bytes) + " B]", m->start, m->end);
        break;
      }
      default:
        break;
    }
  }
  std::free(buffer);
}

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atol(v) : fallback;
}

CUptiResult enable_activity_kinds() {
  const CUpti_ActivityKind kernel_kind = std::getenv("FOURBIT_KTRACE_SERIAL") != nullptr
                                             ? CUPTI_ACTIVITY_KIND_KERNEL  // serializes kernels
                                             : CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
  const CUptiResult k = cuptiActivityEnable(kernel_kind);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET);
  return k;
}

// Callback API subscriber: counts contexts and CUDA runtime calls (entries and exits) the process makes (so an empty
// table says whether CUDA work happened at all while CUPTI watched) and enables the activity kinds
// again per new context (session 25's empty trace: CUPTI never requested a buffer).
void CUPTIAPI on_callback(void*, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void*) {
  if (domain == CUPTI_CB_DOMAIN_RESOURCE && id == CUPTI_CBID_RESOURCE_CONTEXT_CREATED) {
    g_contexts_seen.fetch_add(1);
    enable_activity_kinds();
  } else if (domain == CUPTI_CB_DOMAIN_RUNTIME_API) {
    g_runtime_api_calls.fetch_add(1);
  }
}

void start_tracing() {
  g_rows = new std::map<std::string, Row>();
  g_intervals = new std::vector<Interval>();
  // Subscribe first (CUPTI's guide: before any other CUPTI call). Failure means another CUPTI
  // client holds the process (it is reported in the table's header), not that tracing is off.
  g_subscribe_result = cuptiSubscribe(&g_subscriber, on_callback, nullptr);
  if (g_subscribe_result == CUPTI_SUCCESS) {
    cuptiEnableCallback(1, g_subscriber, CUPTI_CB_DOMAIN_RESOURCE, CUPTI_CBID_RESOURCE_CONTEXT_CREATED);
    cuptiEnableDomain(1, g_subscriber, CUPTI_CB_DOMAIN_RUNTIME_API);
  }
  if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) {
    std::fprintf(stderr, "ktrace: cuptiActivityRegisterCallbacks failed; no kernel table\n");
    return;
  }
  const CUptiResult k = enable_activity_kinds();
  if (k != CUPTI_SUCCESS) {
    const char* msg = nullptr;
    cuptiGetResultString(k, &msg);
    std::fprintf(stderr, "ktrace: cannot trace kernels (%s); no kernel table\n", msg ? msg : "?");
    return;
  }
  g_ok = true;
}
std::once_flag g_started;

// Loaded by LD_PRELOAD: tracing starts with the library. Loaded by the driver through
// CUDA_INJECTION64_PATH (CUPTI's own injection: the driver calls InitializeInjection inside
// cuInit): it starts there instead, after the driver is up (session 27 saw an LD_PRELOAD run whose
// subscriber never got a callback).
__attribute__((constructor)) void start() {
  if (std::getenv("CUDA_INJECTION64_PATH") != nullptr) return;
  std::call_once(g_started, start_tracing);
}

// Flushes CUPTI's buffers and writes the table, once.
void report() {
  if (!g_ok || g_reported.exchange(true)) return;
  const CUptiResult flushed = cuptiActivityFlushAll(1);
  std::vector<std::pair<std::string, Row>> rows;
  std::vector<Interval> intervals;
  double all = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    rows.assign(g_rows->begin(), g_rows->end());
    intervals = *g_intervals;
  }
  for (const auto& [name, r] : rows) all += r.total_ns;
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.total_ns > b.second.total_ns; });
  const char* path = std::getenv("FOURBIT_KTRACE_OUT");
  FILE* out = path != nullptr ? std::fopen(path, "w") : stderr;
  if (out == nullptr) {
    std::fprintf(stderr, "ktrace: cannot write FOURBIT_KTRACE_OUT=%s; the table goes to stderr\n", path);
    out = stderr;
  }
  const long top = env_long("FOURBIT_KTRACE_TOP", 60);
  const size_t width = (size_t)env_long("FOURBIT_KTRACE_WIDTH", 110);
  const char* flush_msg = nullptr;
  cuptiGetResultString(flushed, &flush_msg);
  std::fprintf(out, "ktrace: %zu kernel names, %.3f ms of GPU time in all (%ld activity buffers requested, %ld "
               "returned; flush: %s)\n", rows.size(), all * 1e-6, g_buffers_requested.load(),
               g_buffers_completed.load(), flush_msg != nullptr ? flush_msg : "?");
  if (rows.empty()) {  // say what might have kept CUPTI from recording (session 25 saw this)
    uint32_t version = 0;
    cuptiGetVersion(&version);
    const char* last_msg = nullptr;
    cuptiGetResultString(cuptiGetLastError(), &last_msg);
    const char* injection = std::getenv("CUDA_INJECTION64_PATH");
    const char* subscribe_msg = nullptr;
    cuptiGetResultString(g_subscribe_result, &subscribe_msg);
    std::fprintf(out, "ktrace: nothing recorded; CUPTI API version %u, last CUPTI error: %s, "
                 "cuptiSubscribe: %s, contexts created while subscribed: %ld, runtime API "
                 "callbacks: %ld, CUDA_INJECTION64_PATH=%s (another CUPTI client in the process can take the "
                 "activity API over)\n", version, last_msg != nullptr ? last_msg : "?",
                 subscribe_msg != nullptr ? subscribe_msg : "?", g_contexts_seen.load(),
                 g_runtime_api_calls.load(), injection != nullptr ? injection : "(unset)");
  }
  std::fprintf(out, "%10s %10s %10s %7s  %s\n", "total ms", "launches", "mean us", "share", "kernel");
  long shown = 0;
  for (const auto& [name, r] : rows) {
    if (shown++ >= top) break;
    std::string n = name.size() > width ? name.substr(0, width - 3) + "..." : name;
    std::fprintf(out, "%10.3f %10lld %10.2f %6.2f%%  %s\n", r.total_ns * 1e-6, r.count,
                 r.total_ns * 1e-3 / (double)r.count, 100.0 * r.total_ns / all, n.c_str());
  }
  report_gaps(out, std::move(intervals));
  if (out != stderr) std::fclose(out);
}

__attribute__((destructor)) void finish() { report(); }

}  // namespace

extern "C" __attribute__((visibility("default"))) int InitializeInjection() {
  std::call_once(g_started, start_tracing);
  return 1;
}
