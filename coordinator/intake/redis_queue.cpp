#include "coordinator/intake/redis_queue.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <ctime>
#include <string>

#include "kernels/log.h"

namespace strata {
namespace {

using Clock = Deadline::Clock;

// The fragment both scripts below begin with: stores the result made of ARGV[first ..] in
// stream `results`, marks request `id` done with its entry id in hash `done_hash` and
// records `record` ("<entry id> <content fingerprint>", '' for none) in `content_hash`,
// unless the id already has a result (a retried or duplicate finish). Returns {the result's
// entry id, 'stored' | 'duplicate' | 'conflict', the first entry's record}: 'conflict' when
// the id's first entry had other content than `record` says (ids answered before content
// was recorded have no record and are duplicates).
constexpr const char* kStoreOnceLua = R"lua(
local function store_once(results, done_hash, content_hash, id, record, first)
  local done = redis.call('HGET', done_hash, id)
  if done then
    local seen = redis.call('HGET', content_hash, id)
    if not seen then seen = '' end
    if record ~= '' and seen ~= '' and
        string.match(seen, ' (%x+)$') ~= string.match(record, ' (%x+)$') then
      return {done, 'conflict', seen}
    end
    return {done, 'duplicate', seen}
  end
  local fields = {}
  for i = first, #ARGV do fields[#fields + 1] = ARGV[i] end
  done = redis.call('XADD', results, '*', unpack(fields))
  redis.call('HSET', done_hash, id, done)
  if record ~= '' then redis.call('HSET', content_hash, id, record) end
  return {done, 'stored', ''}
end
)lua";

std::string with_store_once(const char* body) {
  return std::string(kStoreOnceLua) + body;
}

// Stores a result, marks its request id done and acknowledges its entries, atomically; an
// id that already has a result is only acknowledged, unless its content differs (then
// nothing is acknowledged: the entries get a conflict result of their own). Returns
// store_once's answer.
// KEYS: results, done hash, requests, content hash.
// ARGV: group, request id, record, n, n entry ids, fields...
constexpr const char* kFinishLua = R"lua(
local n = tonumber(ARGV[4])
local r = store_once(KEYS[1], KEYS[2], KEYS[4], ARGV[2], ARGV[3], 5 + n)
if r[2] ~= 'conflict' then
  for i = 5, 4 + n do redis.call('XACK', KEYS[3], ARGV[1], ARGV[i]) end
end
return r
)lua";

// Moves an entry to the dead-letter stream and stores its error result, atomically.
// KEYS: dead letters, results, done hash, requests, content hash.
// ARGV: group, request id, entry id, record, n, n dead-letter fields, result fields...
constexpr const char* kDeadLetterLua = R"lua(
local n = tonumber(ARGV[5])
local dead = {}
for i = 6, 5 + n do dead[#dead + 1] = ARGV[i] end
redis.call('XADD', KEYS[1], '*', unpack(dead))
local r = store_once(KEYS[2], KEYS[3], KEYS[5], ARGV[2], ARGV[4], 6 + n)
redis.call('XACK', KEYS[4], ARGV[1], ARGV[3])
return r
)lua";

// Consumer liveness (docs/QUEUE.md "Takeover"): each consumer's mark in the consumers hash
// is the server time (ms) it lasts to; 0 once it ended. The server's clock, so the hosts'
// clocks need not agree. KEYS: consumers. ARGV: consumer, lifetime ms.
constexpr const char* kMarkAliveLua = R"lua(
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[1], ARGV[1], now + tonumber(ARGV[2]))
return now
)lua";

// The other consumers whose mark has run out: name, ms since, name, ms since, ...
// KEYS: consumers. ARGV: this consumer.
constexpr const char* kDeadConsumersLua = R"lua(
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local all = redis.call('HGETALL', KEYS[1])
local out = {}
for i = 1, #all, 2 do
  local until_ms = tonumber(all[i + 1]) or 0
  if all[i] ~= ARGV[1] and until_ms < now then
    out[#out + 1] = all[i]
    out[#out + 1] = tostring(now - until_ms)
  end
end
return out
)lua";
// What a store_once script answered: whether it added a result, and the first entry's
// record when the id's content differs.
struct StoreAnswer {
  bool stored = false;
  bool conflict = false;
  std::string first_record;
};

StoreAnswer store_answer(const RedisReply& r) {
  const std::string& status = r.at(1, "store status").as_string("store status");
  return StoreAnswer{status == "stored", status == "conflict",
                     r.at(2, "store record").as_string("store record")};
}

// The entry id of a content record ("<entry id> <fingerprint>").
std::string first_entry_of(const std::string& record) {
  return record.substr(0, record.find(' '));
}

bool same_content(const std::string& a, const std::string& b) {
  return a.substr(a.find(' ') + 1) == b.substr(b.find(' ') + 1);
}

// The content of an entry: its fields, names and values byte for byte, in any order (the
// producer chose every one of them, the id included), as a 64-bit FNV-1a hash of their
// length-prefixed bytes, in hex. Two entries under one id with other fields are different
// requests; the same fields sent again are the same request.
std::string content_fingerprint(const FieldList& fields) {
  std::vector<const std::pair<std::string, std::string>*> sorted;
  for (const auto& f : fields) sorted.push_back(&f);
  std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) { return *a < *b; });
  uint64_t h = 1469598103934665603ull;
  const auto mix = [&h](std::string_view bytes) {
    const std::string length = std::to_string(bytes.size()) + ":";
    for (const std::string_view part : {std::string_view(length), bytes})
      for (const char ch : part) {
        h ^= static_cast<unsigned char>(ch);
        h *= 1099511628211ull;
      }
  };
  for (const auto* f : sorted) {
    mix(f->first);
    mix(f->second);
  }
  return fmt::format("{:016x}", h);
}

// Error replies that pass (a server loading its data, out of memory for a moment, a
// replica promoted): retried like a lost connection.
bool transient(const std::string& prefix) {
  for (const char* p : {"LOADING", "BUSY", "TRYAGAIN", "OOM", "MASTERDOWN", "READONLY",
                        "CLUSTERDOWN", "NOREPLICAS"})
    if (prefix == p) return true;
  return false;
}

double entry_seconds(const std::string& entry_id) {
  int64_t ms = 0;
  std::from_chars(entry_id.data(), entry_id.data() + entry_id.find('-'), ms);
  return static_cast<double>(ms) / 1000.0;
}

std::chrono::steady_clock::duration every(double seconds, double lo, double hi) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(std::clamp(seconds, lo, hi)));
}

std::string ms_text(double seconds) {
  return std::to_string(static_cast<int64_t>(std::llround(seconds * 1000)));
}

double thread_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

FieldList flat_fields(const nlohmann::ordered_json& object) {
  FieldList out;
  for (const auto& [key, value] : object.items())
    out.emplace_back(key, value.is_string() ? value.get<std::string>() : value.dump());
  return out;
}

void append(RedisArgs& args, const FieldList& fields) {
  for (const auto& [k, v] : fields) {
    args.push_back(k);
    args.push_back(v);
  }
}

}  // namespace

std::string RedisQueueOptions::dead_letters() const {
  return dead_letter_stream.empty() ? request_stream + ":dead" : dead_letter_stream;
}

void RedisQueueOptions::validate() const {
  const std::pair<const char*, const std::string*> names[] = {{"--request-stream", &request_stream},
                                                              {"--result-stream", &result_stream},
                                                              {"--group", &group},
                                                              {"--consumer", &consumer}};
  for (const auto& [option, value] : names)
    if (value->empty()) fail_input("{} must not be empty", option);
  if (request_stream == result_stream || request_stream == dead_letters() ||
      result_stream == dead_letters())
    fail_input("the request, result and dead-letter streams must differ, got '{}', '{}', '{}'",
               request_stream, result_stream, dead_letters());
  if (!(claim_idle_s > 0)) fail_input("--claim-idle must be > 0 seconds, got {}", claim_idle_s);
  if (!(consumer_ttl_s > 0))
    fail_input("--consumer-ttl must be > 0 seconds, got {}", consumer_ttl_s);
  if (max_deliveries < 1) fail_input("--max-deliveries must be >= 1, got {}", max_deliveries);
  if (prefetch < 1) fail_input("the queue's prefetch must be >= 1, got {}", prefetch);
  if (!(retry_timeout_s >= 0))
    fail_input("--redis-timeout must be >= 0 seconds, got {}", retry_timeout_s);
}

std::string RedisQueueOptions::str() const {
  return fmt::format(
      "{} requests '{}' results '{}' dead letters '{}' group '{}' consumer '{}' claim idle {} s, "
      "{} deliveries at most{}",
      endpoint.str(), request_stream, result_stream, dead_letters(), group, consumer, claim_idle_s,
      max_deliveries, exit_when_drained ? ", exits when drained" : "");
}

std::string QueueStats::json() const {
  return fmt::format(R"({{"delivered": {}, "results": {}, "duplicates": {}, "conflicts": {}, )"
                     R"("dead_lettered": {}, "handed_back": {}, "reconnects": {}, )"
                     R"("reader_cpu_seconds": {:.6f}, "writer_cpu_seconds": {:.6f}}})",
                     delivered, results, duplicates, conflicts, dead_lettered, handed_back,
                     reconnects, reader_cpu_seconds, writer_cpu_seconds);
}

RedisQueue::RedisQueue(const RedisQueueOptions& options, const Tokenizer& tokenizer)
    : options_(options),
      tokenizer_(tokenizer),
      finish_script_(with_store_once(kFinishLua)),
      dead_letter_script_(with_store_once(kDeadLetterLua)),
      mark_alive_script_(kMarkAliveLua),
      dead_consumers_script_(kDeadConsumersLua) {
  options_.validate();
  log::get("coordinator")->info("queue: {}", options_.str());
  // The first connection, before anything is served: an unreachable server is retried
  // until the retry budget runs out, then the job ends saying so.
  std::optional<RedisConnection> first;
  while (connection(first, "start") == nullptr) {
    std::lock_guard lock(mutex_);
    if (fatal_) fail(ErrorKind::kFailed, "{}", *fatal_);
  }
  // Alive before anything else can look: a consumer restarted under its old name may find
  // its mark at 0 (ended), and the others must not take what it is about to hold.
  try {
    mark_alive_script_.run(*first, {options_.consumers_hash()},
                           {options_.consumer, ms_text(options_.consumer_ttl_s)},
                           command_deadline());
  } catch (const Error& e) {
    log::get("coordinator")->warn("queue: could not mark this consumer alive yet: {}", e.what());
  }
  first.reset();
  reader_ = std::thread([this] { read_loop(); });
  writer_ = std::thread([this] { write_loop(); });
}

RedisQueue::~RedisQueue() {
  {
    std::lock_guard lock(mutex_);
    quit_ = true;
  }
  wake_.notify_all();
  if (reader_.joinable()) reader_.join();
  if (writer_.joinable()) writer_.join();
}

Deadline RedisQueue::command_deadline() const {
  return Deadline::after_seconds(options_.command_timeout_s);
}

// ---- connections ------------------------------------------------------------------------

RedisConnection* RedisQueue::connection(std::optional<RedisConnection>& slot, const char* role) {
  if (slot && !slot->broken()) return &*slot;
  slot.reset();
  try {
    RedisConnection c = RedisConnection::open(options_.endpoint, command_deadline());
    setup(c);
    slot = std::move(c);
  } catch (const Error& e) {
    on_redis_error(slot, e, role);
    return nullptr;
  }
  std::lock_guard lock(mutex_);
  if (unreachable_since_) {
    const double away = std::chrono::duration<double>(Clock::now() - *unreachable_since_).count();
    log::get("coordinator")
        ->warn("queue: Redis {} is back after {:.1f} s ({})", options_.endpoint.str(), away, role);
    ++stats_.reconnects;
    unreachable_since_.reset();
  }
  return &*slot;
}

// A lost or unreachable server is retried with capped backoff; a group that vanished is
// created again; anything else ends the run (poll throws it).
void RedisQueue::on_redis_error(std::optional<RedisConnection>& slot, const Error& e,
                                const char* role) {
  auto log = log::get("coordinator");
  slot.reset();
  const auto* reply = dynamic_cast<const RedisError*>(&e);
  std::unique_lock lock(mutex_);
  if (reply != nullptr && !transient(reply->prefix()) && reply->prefix() != "NOGROUP") {
    if (!fatal_) fatal_ = fmt::format("Redis {}: {}", options_.endpoint.str(), e.what());
    log->error("queue: {} ({}); the run cannot go on", *fatal_, role);
    wake_.notify_all();
    return;
  }
  const Clock::time_point now = Clock::now();
  if (!unreachable_since_) {
    unreachable_since_ = now;
    log->warn(
        "queue: {} ({}); retrying with backoff up to 2 s, finished results wait in memory, "
        "nothing is acknowledged without its result",
        e.what(), role);
  }
  const double away = std::chrono::duration<double>(now - *unreachable_since_).count();
  if (options_.retry_timeout_s > 0 && away > options_.retry_timeout_s && !fatal_) {
    fatal_ = fmt::format("Redis {} unreachable for {:.0f} s (--redis-timeout {} s): {}",
                         options_.endpoint.str(), away, options_.retry_timeout_s, e.what());
    log->error("queue: {}", *fatal_);
    wake_.notify_all();
    return;
  }
  // Capped exponential backoff, cut short when the queue is destroyed.
  const double pause = std::min(2.0, 0.05 * std::pow(2.0, std::min(away, 10.0)));
  wake_.wait_for(lock, std::chrono::duration<double>(pause), [this] { return quit_; });
}

void RedisQueue::setup(RedisConnection& c) {
  try {
    c.command({"XGROUP", "CREATE", options_.request_stream, options_.group, "0", "MKSTREAM"},
              command_deadline());
    log::get("coordinator")
        ->info("queue: created group '{}' on '{}' from the stream's start", options_.group,
               options_.request_stream);
  } catch (const RedisError& e) {
    if (e.prefix() != "BUSYGROUP") throw;  // BUSYGROUP: it exists, as on every restart
  }
  std::call_once(durability_checked_, [&] { warn_about_durability(c); });
}

// Acknowledged work survives a restart of Redis only with an append-only file, and stream
// entries survive memory pressure only without eviction.
void RedisQueue::warn_about_durability(RedisConnection& c) {
  auto log = log::get("coordinator");
  try {
    const RedisReply aof = c.command({"CONFIG", "GET", "appendonly"}, command_deadline());
    const RedisReply policy = c.command({"CONFIG", "GET", "maxmemory-policy"}, command_deadline());
    if (aof.size() == 2 && aof.elements[1].str == "no")
      log->warn(
          "queue: Redis {} runs with appendonly no: if it restarts, queued requests, results "
          "and acknowledgements since its last snapshot are lost (set appendonly yes)",
          options_.endpoint.str());
    if (policy.size() == 2 && policy.elements[1].str != "noeviction")
      log->warn(
          "queue: Redis {} has maxmemory-policy {}: under memory pressure it may evict the "
          "streams (set noeviction)",
          options_.endpoint.str(), policy.elements[1].str);
  } catch (const RedisError& e) {
    log->warn("queue: cannot check Redis's persistence settings ({})", e.what());
  }
}

// ---- the reader: own pending entries, idle entries of others, new entries -------------------

void RedisQueue::read_loop() {
  std::optional<RedisConnection> slot;
  Clock::time_point next_claim = Clock::now();
  Clock::time_point next_takeover = Clock::now();
  while (true) {
    {
      std::unique_lock lock(mutex_);
      stats_.reader_cpu_seconds = thread_cpu_seconds();
      if (quit_) return;
      // Nothing is taken before the coordinator first asks (its stages may take minutes to
      // load, or never do): until then another consumer serves what is queued.
      if (fatal_ || stopped_ || drained_ || !serving_) {
        wake_.wait_for(lock, std::chrono::milliseconds(100));
        continue;
      }
    }
    RedisConnection* c = connection(slot, "reader");
    if (c == nullptr) continue;
    try {
      if (Clock::now() >= next_takeover) {
        take_over_dead(*c);
        next_takeover = Clock::now() + every(options_.consumer_ttl_s / 4, 0.05, 1.0);
      }
      if (Clock::now() >= next_claim) {
        claim_idle(*c);
        next_claim = Clock::now() + every(options_.claim_idle_s / 2, 0.05, 5.0);
      }
      read_once(*c);
    } catch (const Error& e) {
      on_redis_error(slot, e, "reader");
    }
  }
}

void RedisQueue::read_once(RedisConnection& c) {
  if (recover(c)) return;
  read_new(c);
}

// Own pending entries not held by this run: entries of an earlier run under this consumer
// name, or claimed from a dead consumer. Those handed back whole (deliveries 0: never run
// to a failure) come back together; the others one at a time and only when nothing else
// is held, each then running alone, so that the one that fails a run is the only one
// whose delivery count grows.
bool RedisQueue::recover(RedisConnection& c) {
  {
    std::lock_guard lock(mutex_);
    if (!recovering_) return false;
  }
  std::vector<std::string> innocent;
  std::optional<std::pair<std::string, int64_t>> suspect;
  std::string start = "-";
  while (innocent.empty() && !suspect) {
    const RedisReply page = c.command(
        {"XPENDING", options_.request_stream, options_.group, start, "+", "256", options_.consumer},
        command_deadline());
    if (page.size() == 0) break;
    std::lock_guard lock(mutex_);
    for (const RedisReply& row : page.elements) {
      const std::string& id = row.at(0, "XPENDING id").as_string("XPENDING id");
      const int64_t count = row.at(3, "XPENDING deliveries").as_integer("XPENDING deliveries");
      if (held_entries_.contains(id)) continue;
      if (count == 0) {
        innocent.push_back(id);
      } else if (!suspect) {
        suspect.emplace(id, count);
      }
    }
    start = "(" + page.elements.back().elements[0].str;
  }
  if (innocent.empty() && !suspect) {
    std::lock_guard lock(mutex_);
    recovering_ = false;
    return false;
  }
  if (!innocent.empty()) {
    RedisArgs claim{"XCLAIM", options_.request_stream, options_.group, options_.consumer, "0"};
    claim.insert(claim.end(), innocent.begin(), innocent.end());
    std::vector<Entry> entries = entries_of(c.command(claim, command_deadline()));
    for (Entry& e : entries) e.deliveries = 1;
    deliver(c, std::move(entries));
    return true;
  }
  {
    std::unique_lock lock(mutex_);
    // A suspect that failed this run while XPENDING was on the wire is no longer held and
    // looks like one to take; claiming it would count a delivery that never runs.
    if (stopped_ || fatal_) return true;
    if (!held_.empty() || !buffer_.empty()) {
      wake_.wait_for(lock, std::chrono::milliseconds(20));
      return true;
    }
  }
  std::vector<Entry> entries = entries_of(c.command(
      {"XCLAIM", options_.request_stream, options_.group, options_.consumer, "0", suspect->first},
      command_deadline()));
  for (Entry& e : entries) e.deliveries = suspect->second + 1;
  // An entry deleted from the stream leaves the pending list on XCLAIM and comes back empty.
  deliver(c, std::move(entries));
  return true;
}

// Entries of a consumer known dead (its liveness mark ran out, or it ended) become this
// consumer's at once, without counting a delivery (JUSTID); recover() then takes them. A
// dead consumer left with nothing pending is removed from the group and the hash, so
// neither grows with every job that ever ran.
void RedisQueue::take_over_dead(RedisConnection& c) {
  const RedisReply dead = dead_consumers_script_.run(c, {options_.consumers_hash()},
                                                     {options_.consumer}, command_deadline());
  for (size_t i = 0; i + 1 < dead.size(); i += 2) {
    const std::string& name = dead.elements[i].str;
    size_t taken = 0;
    for (int page = 0; page < 64; ++page) {
      const RedisReply pending =
          c.command({"XPENDING", options_.request_stream, options_.group, "-", "+", "256", name},
                    command_deadline());
      if (pending.size() == 0) break;
      RedisArgs claim{"XCLAIM", options_.request_stream, options_.group, options_.consumer, "0"};
      for (const RedisReply& row : pending.elements)
        claim.push_back(row.at(0, "XPENDING id").as_string("XPENDING id"));
      claim.emplace_back("JUSTID");
      c.command(claim, command_deadline());
      taken += pending.size();
    }
    const RedisReply left =
        c.command({"XPENDING", options_.request_stream, options_.group, "-", "+", "1", name},
                  command_deadline());
    if (left.size() == 0) {
      c.command({"XGROUP", "DELCONSUMER", options_.request_stream, options_.group, name},
                command_deadline());
      c.command({"HDEL", options_.consumers_hash(), name}, command_deadline());
    }
    if (taken == 0) continue;
    log::get("coordinator")
        ->warn(
            "queue: consumer '{}' is gone (its liveness mark ran out {} ms ago): took over "
            "its {} pending entries",
            log::printable(name), dead.elements[i + 1].str, taken);
    std::lock_guard lock(mutex_);
    recovering_ = true;
  }
}

// Entries another consumer has held longer than claim_idle_s (it died or hangs) become
// this consumer's, without counting a delivery (JUSTID); recover() then takes them.
void RedisQueue::claim_idle(RedisConnection& c) {
  std::string cursor = "0-0";
  bool claimed = false;
  for (int round = 0; round < 16; ++round) {
    const RedisReply r =
        c.command({"XAUTOCLAIM", options_.request_stream, options_.group, options_.consumer,
                   ms_text(options_.claim_idle_s), cursor, "COUNT", "256", "JUSTID"},
                  command_deadline());
    cursor = r.at(0, "XAUTOCLAIM cursor").as_string("XAUTOCLAIM cursor");
    {
      std::lock_guard lock(mutex_);
      for (const RedisReply& id : r.at(1, "XAUTOCLAIM ids").elements)
        claimed = claimed || !held_entries_.contains(id.str);
    }
    if (cursor == "0-0") break;
  }
  if (!claimed) return;
  log::get("coordinator")
      ->warn("queue: took over entries idle for more than {} s on other consumers",
             options_.claim_idle_s);
  std::lock_guard lock(mutex_);
  recovering_ = true;
}

void RedisQueue::read_new(RedisConnection& c) {
  size_t room = 0;
  {
    std::unique_lock lock(mutex_);
    // While a redelivered entry runs alone, nothing new is read: if it fails this run too,
    // no other entry's delivery count grows with it.
    const bool suspect_held = std::any_of(held_.begin(), held_.end(),
                                          [](const auto& h) { return h.second.deliveries > 1; });
    room = suspect_held ? 0 : options_.prefetch - std::min(options_.prefetch, buffer_.size());
    if (room == 0) {  // poll() wakes this when the coordinator takes entries
      wake_.wait_for(lock, std::chrono::milliseconds(100));
      return;
    }
  }
  const auto block_ms = static_cast<int64_t>(options_.block_s * 1000);
  const RedisReply r = c.command(
      {"XREADGROUP", "GROUP", options_.group, options_.consumer, "COUNT", std::to_string(room),
       "BLOCK", std::to_string(block_ms), "STREAMS", options_.request_stream, ">"},
      Deadline::after_seconds(options_.block_s + options_.command_timeout_s));
  if (r.is_nil() || r.size() == 0) {
    if (options_.exit_when_drained) check_drained(c);
    return;
  }
  deliver(c, entries_of(r.at(0, "XREADGROUP stream").at(1, "XREADGROUP entries")));
}

// Drained: nothing new, nothing pending anywhere in the group, nothing held here.
void RedisQueue::check_drained(RedisConnection& c) {
  {
    std::lock_guard lock(mutex_);
    if (recovering_ || !held_.empty() || !buffer_.empty() || !outbox_.empty()) return;
  }
  const RedisReply summary =
      c.command({"XPENDING", options_.request_stream, options_.group}, command_deadline());
  if (summary.at(0, "XPENDING count").as_integer("XPENDING count") != 0) return;
  std::lock_guard lock(mutex_);
  drained_ = true;
  log::get("coordinator")->info("queue: '{}' is drained", options_.request_stream);
}

std::vector<RedisQueue::Entry> RedisQueue::entries_of(const RedisReply& list) const {
  std::vector<Entry> out;
  for (const RedisReply& e : list.elements) {
    Entry entry;
    entry.id = e.at(0, "entry id").as_string("entry id");
    const RedisReply& fields = e.at(1, "entry fields");
    if (fields.is_nil()) continue;  // deleted from the stream while pending
    for (size_t i = 0; i + 1 < fields.size(); i += 2)
      entry.fields.emplace_back(fields.elements[i].str, fields.elements[i + 1].str);
    out.push_back(std::move(entry));
  }
  return out;
}

RedisScript RedisQueue::finish_script() {
  return RedisScript(with_store_once(kFinishLua));
}

// Parses entries and hands them to the coordinator, except those whose id already has a
// result (acknowledged; with other content: a conflict result), those delivered too often
// (dead letters) and repeats of an id this run holds (acknowledged with it; with other
// content: a conflict result).
void RedisQueue::deliver(RedisConnection& c, std::vector<Entry> entries) {
  if (entries.empty()) return;
  std::vector<IncomingRequest> requests;
  std::vector<std::string> records;
  RedisArgs done_lookup{"HMGET", options_.done_hash()};
  RedisArgs content_lookup{"HMGET", content_hash()};
  for (const Entry& e : entries) {
    requests.push_back(parse_request_fields(
        e.fields, e.id, fmt::format("{} entry {}", options_.request_stream, e.id),
        options_.limits));
    requests.back().arrival = entry_seconds(e.id);
    requests.back().deliveries = e.deliveries;
    records.push_back(e.id + " " + content_fingerprint(e.fields));
    done_lookup.push_back(requests.back().request.id);
    content_lookup.push_back(requests.back().request.id);
  }
  std::optional<PromptPrep> prep;
  {
    std::lock_guard lock(mutex_);
    prep = prep_;
  }
  // Tokenized here, off the coordinator's loop: a long prompt delays only the reader.
  if (prep)
    for (IncomingRequest& r : requests) prepare_prompt(r, *prep);
  const std::vector<RedisReply> replies =
      c.pipeline(std::vector<RedisArgs>{done_lookup, content_lookup}, command_deadline());
  for (const RedisReply& r : replies)
    if (r.type == RedisReply::Type::kError) throw RedisError(r.str);
  const RedisReply& done = replies[0];
  const RedisReply& seen = replies[1];
  std::vector<const Entry*> not_taken;
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string& id = requests[i].request.id;
    if (!done.at(i, "HMGET").is_nil()) {
      const RedisReply& first = seen.at(i, "HMGET");
      if (!first.is_nil() && !same_content(first.str, records[i])) {
        answer_conflict(c, reader_finish_script_, entries[i].id, id, first_entry_of(first.str));
        continue;
      }
      c.command({"XACK", options_.request_stream, options_.group, entries[i].id},
                command_deadline());
      std::lock_guard lock(mutex_);
      ++stats_.duplicates;
      continue;
    }
    if (entries[i].deliveries > options_.max_deliveries) {
      dead_letter(c, entries[i], requests[i], records[i]);
      continue;
    }
    std::optional<std::string> conflict;  // the first entry of the id this run holds
    {
      std::lock_guard lock(mutex_);
      if (stopped_) {  // read while the run stopped or failed: it will not run here
        not_taken.push_back(&entries[i]);
        continue;
      }
      auto [held, fresh] =
          held_.try_emplace(id, Held{{entries[i].id}, entries[i].deliveries, records[i]});
      if (!fresh && !same_content(held->second.record, records[i])) {
        conflict = first_entry_of(held->second.record);
      } else if (!fresh) {  // the same id again while it runs: answered together
        held_entries_.insert(entries[i].id);
        held->second.entries.push_back(entries[i].id);
        ++stats_.duplicates;
        continue;
      } else {
        held_entries_.insert(entries[i].id);
        ++stats_.delivered;
        buffer_.push_back(std::move(requests[i]));
        continue;
      }
    }
    answer_conflict(c, reader_finish_script_, entries[i].id, id, *conflict);
  }
  for (const Entry* e : not_taken) hand_back(c, {e->id}, e->deliveries);
}

void RedisQueue::answer_conflict(RedisConnection& c, RedisScript& script, const std::string& entry,
                                 const std::string& request_id, const std::string& first_entry) {
  GenerationResult result;
  result.id = entry;
  result.stop_reason = StopReason::kError;
  result.error_kind = ErrorKind::kInvalidInput;
  result.error = fmt::format(
      "field 'id': '{}' was used first by entry {} with other content (its result is the one "
      "under that id); this entry is not run and its result is named by its entry id: send it "
      "again under an id of its own",
      request_id, first_entry);
  FieldList fields = flat_fields(result_object(result, tokenizer_));
  fields.emplace_back("entry", entry);
  fields.emplace_back("reused_id", request_id);
  fields.emplace_back("first_entry", first_entry);
  RedisArgs args{options_.group, entry, "", "1", entry};
  append(args, fields);
  const StoreAnswer answer = store_answer(script.run(
      c, {options_.result_stream, options_.done_hash(), options_.request_stream, content_hash()},
      args, command_deadline()));
  log::get("coordinator")
      ->warn("queue: entry {} reuses id {} of entry {} with other content: answered with an error",
             entry, log::printable(request_id), first_entry);
  std::lock_guard lock(mutex_);
  ++stats_.conflicts;
  if (answer.stored) ++stats_.results;
}

// Entries this run took and will not finish go back with the delivery count they had
// before it took them and their lease expired, so the next consumer takes them at once.
void RedisQueue::hand_back(RedisConnection& c, const std::vector<std::string>& entries,
                           int64_t deliveries) {
  RedisArgs claim{"XCLAIM", options_.request_stream, options_.group, options_.consumer, "0"};
  claim.insert(claim.end(), entries.begin(), entries.end());
  claim.insert(claim.end(), {"IDLE", ms_text(options_.claim_idle_s), "RETRYCOUNT",
                             std::to_string(std::max<int64_t>(0, deliveries - 1)), "JUSTID"});
  c.command(claim, command_deadline());
}

void RedisQueue::dead_letter(RedisConnection& c, const Entry& entry, const IncomingRequest& r,
                             const std::string& record) {
  GenerationResult result;
  result.id = r.request.id;
  result.prompt_ids = r.request.prompt_ids;
  result.stop_reason = StopReason::kError;
  result.error = fmt::format(
      "dead-lettered: delivered {} times (limit {}), and each run that took it ended before it "
      "finished, so it is taken to be what failed them; the entry is kept in '{}'",
      entry.deliveries, options_.max_deliveries, options_.dead_letters());
  FieldList dead = entry.fields;
  dead.emplace_back("dead_letter_entry", entry.id);
  dead.emplace_back("dead_letter_deliveries", std::to_string(entry.deliveries));
  dead.emplace_back("dead_letter_consumer", options_.consumer);
  RedisArgs args{options_.group, r.request.id, entry.id, record, std::to_string(2 * dead.size())};
  append(args, dead);
  FieldList fields = flat_fields(result_object(result, tokenizer_));
  fields.emplace_back("entry", entry.id);
  append(args, fields);
  const StoreAnswer answer = store_answer(
      dead_letter_script_.run(c,
                              {options_.dead_letters(), options_.result_stream,
                               options_.done_hash(), options_.request_stream, content_hash()},
                              args, command_deadline()));
  log::get("coordinator")
      ->error("queue: request {} (entry {}) dead-lettered after {} deliveries",
              log::printable(r.request.id), entry.id, entry.deliveries);
  std::lock_guard lock(mutex_);
  ++stats_.dead_lettered;
  if (answer.stored) ++stats_.results;
}

// ---- the coordinator's side ---------------------------------------------------------------

std::vector<IncomingRequest> RedisQueue::poll(size_t max) {
  std::lock_guard lock(mutex_);
  if (fatal_) fail(ErrorKind::kDisconnected, "{}", *fatal_);
  if (!serving_) {
    serving_ = true;
    wake_.notify_all();
  }
  std::vector<IncomingRequest> out;
  while (!buffer_.empty() && out.size() < max) {
    out.push_back(std::move(buffer_.front()));
    buffer_.pop_front();
  }
  if (!out.empty()) wake_.notify_all();  // room to read ahead again
  return out;
}

void RedisQueue::prepare_with(const PromptPrep& prep) {
  std::lock_guard lock(mutex_);
  prep_ = prep;
}

bool RedisQueue::exhausted() const {
  std::lock_guard lock(mutex_);
  return (drained_ || stopped_) && buffer_.empty();
}

std::vector<IncomingRequest> RedisQueue::stop() {
  std::lock_guard lock(mutex_);
  stopped_ = true;
  std::vector<IncomingRequest> rest(std::make_move_iterator(buffer_.begin()),
                                    std::make_move_iterator(buffer_.end()));
  buffer_.clear();
  return rest;
}

void RedisQueue::write(const GenerationResult& result) {
  FieldList fields = flat_fields(result_object(result, tokenizer_));
  std::lock_guard lock(mutex_);
  STRATA_CHECK(held_.contains(result.id), "result for request {}, which the queue does not hold",
               result.id);
  if (outbox_.size() >= options_.max_waiting_results)
    fail(ErrorKind::kOverloaded, "{} results are waiting for Redis {}; no room for more",
         outbox_.size(), options_.endpoint.str());
  outbox_.push_back(Outgoing{result.id, std::move(fields)});
  wake_.notify_all();
}

// A request that may have failed the run stays pending as it is (its delivery count says
// so); any other goes back with its count restored and its lease expired, so this or
// another consumer takes it at once.
void RedisQueue::unfinished(const GenerationResult& partial, bool suspect) {
  std::lock_guard lock(mutex_);
  auto it = held_.find(partial.id);
  if (it == held_.end()) return;
  if (suspect) {
    // The run is failing: nothing more is read or recovered, or the reader would take this
    // very entry back (own pending, no longer held) and count a delivery that never ran.
    stopped_ = true;
    for (const std::string& e : it->second.entries) held_entries_.erase(e);
    held_.erase(it);
    return;
  }
  outbox_.push_back(Outgoing{partial.id, {}});
  wake_.notify_all();
}

bool RedisQueue::flush(const Deadline& deadline) {
  std::unique_lock lock(mutex_);
  wake_.wait_until(lock, deadline.at(), [this] { return outbox_.empty() || fatal_.has_value(); });
  return outbox_.empty();
}

QueueStats RedisQueue::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

// ---- the writer: results, hand-backs, leases ---------------------------------------------

void RedisQueue::write_loop() {
  std::optional<RedisConnection> slot;
  const Clock::duration lease_every = every(options_.claim_idle_s / 3, 0.05, 10.0);
  const Clock::duration mark_every = every(options_.consumer_ttl_s / 3, 0.05, 10.0);
  Clock::time_point next_lease = Clock::now() + lease_every;
  Clock::time_point next_mark = Clock::now();
  while (true) {
    {
      std::unique_lock lock(mutex_);
      wake_.wait_until(lock, std::min(next_lease, next_mark),
                       [this] { return quit_ || (!outbox_.empty() && !fatal_); });
      stats_.writer_cpu_seconds = thread_cpu_seconds();
      if (quit_) return mark_ended(slot);
      if (fatal_) continue;
    }
    RedisConnection* c = connection(slot, "writer");
    if (c == nullptr) continue;
    try {
      if (Clock::now() >= next_mark) {
        mark_alive_script_.run(*c, {options_.consumers_hash()},
                               {options_.consumer, ms_text(options_.consumer_ttl_s)},
                               command_deadline());
        next_mark = Clock::now() + mark_every;
      }
      write_once(*c);
      if (Clock::now() >= next_lease) {
        renew_leases(*c);
        next_lease = Clock::now() + lease_every;
      }
    } catch (const Error& e) {
      on_redis_error(slot, e, "writer");
    }
  }
}

void RedisQueue::write_once(RedisConnection& c) {
  while (true) {
    Outgoing out;
    {
      std::lock_guard lock(mutex_);
      if (outbox_.empty()) return;
      out = outbox_.front();
    }
    store(c, out);  // throws on a Redis failure: the item stays first in line
    std::lock_guard lock(mutex_);
    outbox_.pop_front();
    wake_.notify_all();  // flush() waits for an empty outbox
  }
}

// One result (or hand-back) for every entry held under its id, including repeats of the
// id that arrive while it is being stored. Counted as a result only when the script added
// one: an id another consumer answered meanwhile is a duplicate (same content) or a
// conflict (other content: each entry then gets an error result of its own).
void RedisQueue::store(RedisConnection& c, const Outgoing& out) {
  size_t done_entries = 0;
  bool stored = false;
  bool conflict = false;
  while (true) {
    Held held;
    {
      std::lock_guard lock(mutex_);
      auto it = held_.find(out.request_id);
      if (it == held_.end() || it->second.entries.size() == done_entries) {
        if (it != held_.end()) {
          for (const std::string& e : it->second.entries) held_entries_.erase(e);
          held_.erase(it);
          if (out.fields.empty()) {
            ++stats_.handed_back;
          } else if (stored) {
            ++stats_.results;
          } else if (!conflict) {
            ++stats_.duplicates;
          }
        }
        return;
      }
      held = it->second;
    }
    const std::vector<std::string> entries(
        held.entries.begin() + static_cast<ptrdiff_t>(done_entries), held.entries.end());
    if (out.fields.empty()) {
      hand_back(c, entries, held.deliveries);
    } else {
      RedisArgs args{options_.group, out.request_id, held.record, std::to_string(entries.size())};
      args.insert(args.end(), entries.begin(), entries.end());
      append(args, out.fields);
      args.push_back("entry");
      args.push_back(held.entries.front());
      const StoreAnswer answer = store_answer(finish_script_.run(
          c,
          {options_.result_stream, options_.done_hash(), options_.request_stream, content_hash()},
          args, command_deadline()));
      // A retry after a lost reply finds its own record: this run stored it.
      stored = stored || answer.stored ||
               (!answer.conflict && first_entry_of(answer.first_record) == held.entries.front());
      if (answer.conflict) {
        conflict = true;
        for (const std::string& e : entries)
          answer_conflict(c, finish_script_, e, out.request_id,
                          first_entry_of(answer.first_record));
      }
    }
    done_entries = held.entries.size();
  }
}

// This consumer is over: what it still holds (entries that were running when the run failed)
// is for the next consumer to take at once. Best effort, on a live connection only.
void RedisQueue::mark_ended(std::optional<RedisConnection>& slot) {
  if (!slot || slot->broken()) return;
  try {
    slot->command({"HSET", options_.consumers_hash(), options_.consumer, "0"},
                  Deadline::after_seconds(std::min(options_.command_timeout_s, 2.0)));
  } catch (const Error& e) {
    log::get("coordinator")->warn("queue: could not mark this consumer ended: {}", e.what());
  }
}

// Keeps every held entry's idle time low, so no other consumer takes it over while this
// run works on it (XCLAIM with JUSTID does not count a delivery).
void RedisQueue::renew_leases(RedisConnection& c) {
  std::vector<std::string> ids;
  {
    std::lock_guard lock(mutex_);
    ids.assign(held_entries_.begin(), held_entries_.end());
  }
  constexpr size_t kChunk = 512;
  for (size_t i = 0; i < ids.size(); i += kChunk) {
    RedisArgs claim{"XCLAIM", options_.request_stream, options_.group, options_.consumer, "0"};
    const size_t end = std::min(ids.size(), i + kChunk);
    claim.insert(claim.end(), ids.begin() + static_cast<ptrdiff_t>(i),
                 ids.begin() + static_cast<ptrdiff_t>(end));
    claim.emplace_back("JUSTID");
    c.command(claim, command_deadline());
  }
}

}  // namespace strata
