// The Redis queue behind the coordinator's RequestSource / ResultSink seam (docs/QUEUE.md).
//
// Requests are entries of a stream read through a consumer group; results are entries of a
// results stream. Delivery is at-least-once in and exactly one result out:
//  - an entry is acknowledged only in the same Lua script that stores its result and marks
//    its id done (the done hash), so a crash at any point loses nothing and answers nothing
//    twice; an entry whose id is already done is acknowledged without running again;
//  - a restarted consumer takes back its own pending entries first, then new ones; entries
//    pending on another consumer for longer than `claim_idle_s` are taken over
//    (XAUTOCLAIM), and entries this consumer holds are kept leased (XCLAIM ... JUSTID);
//  - each consumer renews a liveness mark (the consumers hash); the entries of one whose
//    mark ran out or that ended are taken over at once, without waiting out claim_idle_s;
//  - nothing is read before the coordinator first polls (its stages have loaded);
//  - an entry handed out more than `max_deliveries` times goes to the dead-letter stream
//    with an error result; one handed out again after a failed run (deliveries > 1) is run
//    alone by the coordinator, so a poison entry is found without taking others with it;
//  - entries are read only as fast as the coordinator admits them (`prefetch` ahead): the
//    stream, not memory, holds the backlog; the request stream is never trimmed.
// Two threads with a connection each talk to Redis (reads and claims; results, hand-backs
// and leases), so the coordinator's loop never waits for Redis. Lost connections are
// retried with capped backoff; results wait in memory until Redis is back; the run fails
// only after `retry_timeout_s` without Redis.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/intake/intake.h"
#include "transport/redis_client.h"

namespace strata {

struct RedisQueueOptions {
  RedisEndpoint endpoint;
  std::string request_stream = "strata:requests";
  std::string result_stream = "strata:results";
  std::string dead_letter_stream;  // empty: <request_stream>:dead
  std::string group = "strata";
  std::string consumer;      // this job's name in the group (serve: host name + job id)
  double claim_idle_s = 60;  // another consumer's entries idle this long are taken over
  // This consumer's liveness mark lasts this long unless renewed (every third of it); the
  // entries of a consumer whose mark ran out, or that ended, are taken over at once.
  double consumer_ttl_s = 3;
  int64_t max_deliveries = 3;  // more deliveries than this: the dead-letter stream
  bool exit_when_drained = false;
  size_t prefetch = 32;                  // entries read ahead of the coordinator's admission
  double retry_timeout_s = 300;          // Redis unreachable this long fails the run; 0: never
  double command_timeout_s = 10;         // one Redis command
  double block_s = 0.2;                  // one blocking read of new entries
  size_t max_waiting_results = 1 << 16;  // results held while Redis is away
  InputLimits limits;                    // request_bytes and json_depth bound each entry

  std::string dead_letters() const;
  std::string done_hash() const { return result_stream + ":done"; }
  // Consumer name -> server time (ms) its liveness mark lasts to, 0 once it ended.
  std::string consumers_hash() const { return request_stream + ":consumers:" + group; }
  void validate() const;  // InputError naming the option
  std::string str() const;
};

struct QueueStats {
  int64_t delivered = 0;  // entries handed to the coordinator
  // Results this run added to the results stream (finished, refused, conflicting and
  // dead-lettered requests): what the stream gained, not entries acknowledged with them.
  int64_t results = 0;
  int64_t duplicates = 0;  // entries acknowledged because their id had a result with their content
  int64_t conflicts = 0;   // entries whose id had been used with other content: error results
  int64_t dead_lettered = 0;      // entries moved to the dead-letter stream
  int64_t handed_back = 0;        // entries left for a later run (stopped before finishing)
  int64_t reconnects = 0;         // connections opened after a loss
  double reader_cpu_seconds = 0;  // CPU time of the two I/O threads
  double writer_cpu_seconds = 0;
  std::string json() const;
};

class RedisQueue final : public RequestSource, public ResultSink {
 public:
  // Connects (retrying within retry_timeout_s), creates the group from the stream's start
  // if it does not exist, warns about a server configured to lose acknowledged work, and
  // starts the I/O threads. `tokenizer` renders result texts.
  RedisQueue(const RedisQueueOptions& options, const Tokenizer& tokenizer);
  ~RedisQueue() override;
  RedisQueue(const RedisQueue&) = delete;
  RedisQueue& operator=(const RedisQueue&) = delete;

  std::vector<IncomingRequest> poll(size_t max) override;
  bool exhausted() const override;
  std::vector<IncomingRequest> stop() override;
  void prepare_with(const PromptPrep& prep) override;  // the reader tokenizes from now on

  void write(const GenerationResult& result) override;
  void unfinished(const GenerationResult& partial, bool suspect) override;
  bool flush(const Deadline& deadline) override;

  QueueStats stats() const;

 private:
  struct Entry {  // one stream entry as read
    std::string id;
    FieldList fields;
    int64_t deliveries = 1;
  };
  struct Held {  // a request id handed out and not finished: its entries (duplicates too)
    std::vector<std::string> entries;
    int64_t deliveries = 1;
    std::string record;  // "<first entry id> <content fingerprint>"
  };
  struct Outgoing {
    std::string request_id;
    FieldList fields;  // empty: hand the entries back instead of storing a result
  };

  // Both threads: a live connection, or nullopt after logging and backing off.
  RedisConnection* connection(std::optional<RedisConnection>& slot, const char* role);
  void on_redis_error(std::optional<RedisConnection>& slot, const Error& e, const char* role);
  void setup(RedisConnection& c);
  void warn_about_durability(RedisConnection& c);

  void read_loop();
  void read_once(RedisConnection& c);
  bool recover(RedisConnection& c);  // true while own pending entries remain to take back
  void claim_idle(RedisConnection& c);
  void take_over_dead(RedisConnection& c);
  void mark_ended(std::optional<RedisConnection>& slot);
  void read_new(RedisConnection& c);
  void check_drained(RedisConnection& c);
  void deliver(RedisConnection& c, std::vector<Entry> entries);
  void hand_back(RedisConnection& c, const std::vector<std::string>& entries, int64_t deliveries);
  void dead_letter(RedisConnection& c, const Entry& entry, const IncomingRequest& request,
                   const std::string& record);
  // An entry whose id was used first by `first_entry` with other content: an error result
  // named by the entry's own id, stored and acknowledged with `script` (each thread has
  // its own).
  void answer_conflict(RedisConnection& c, RedisScript& script, const std::string& entry,
                       const std::string& request_id, const std::string& first_entry);
  std::string content_hash() const { return options_.result_stream + ":content"; }

  void write_loop();
  void write_once(RedisConnection& c);
  void store(RedisConnection& c, const Outgoing& out);
  void renew_leases(RedisConnection& c);

  Deadline command_deadline() const;
  std::vector<Entry> entries_of(const RedisReply& list) const;

  RedisQueueOptions options_;
  const Tokenizer& tokenizer_;
  RedisScript finish_script_;
  RedisScript dead_letter_script_;
  RedisScript mark_alive_script_;                       // the writer's
  RedisScript dead_consumers_script_;                   // the reader's
  RedisScript reader_finish_script_ = finish_script();  // the reader's conflict results
  static RedisScript finish_script();

  std::once_flag durability_checked_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;        // every wait of both threads and flush()
  std::deque<IncomingRequest> buffer_;  // read, not yet polled
  std::map<std::string, Held> held_;    // by request id
  std::set<std::string> held_entries_;  // every entry id in held_
  std::deque<Outgoing> outbox_;         // results and hand-backs for the writer
  size_t writing_ = 0;                  // outbox items the writer is storing now
  bool recovering_ = true;              // own pending entries may remain
  bool stopped_ = false;                // stop(): read nothing more
  bool serving_ = false;                // the coordinator has polled: reading may start
  bool drained_ = false;
  bool quit_ = false;                 // the destructor: threads end
  std::optional<std::string> fatal_;  // the run cannot go on (poll throws it)
  std::optional<Deadline::Clock::time_point> unreachable_since_;
  QueueStats stats_;
  std::optional<PromptPrep> prep_;  // set: the reader tokenizes what it delivers

  std::thread reader_;
  std::thread writer_;
};

}  // namespace strata
