// A Redis client over hiredis's synchronous API (Debian's hiredis 0.14): one connection per
// RedisConnection, owned (RAII), used from one thread at a time. Every command has a
// deadline (the socket's read/write timeout is set from it), so a server that stops
// answering becomes an Error, never a hang. Failures are classified at this boundary, by
// what the caller can do (docs/CONVENTIONS.md, "Errors"): a lost or unreachable server is
// kDisconnected (reconnect and retry), an error reply is RedisError (kFailed, with Redis's
// own message and prefix).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/error.h"
#include "transport/deadline.h"

struct redisContext;

namespace strata {

// redis://[[user]:password@]host[:port][/db] (Redis 6 ACL user, or a password alone).
struct RedisEndpoint {
  std::string host = "127.0.0.1";
  int port = 6379;
  std::string user;
  std::string password;
  int db = 0;

  // Throws InputError naming the part of the URL that is wrong (the password never shown).
  // redis://user@host names a user whose password comes from elsewhere (resolve).
  static RedisEndpoint parse(std::string_view url);
  // parse(), with the password, where the URL has none, from `password_file` (its first
  // line; "" for none), else $STRATA_REDIS_PASSWORD, else $REDISCLI_AUTH (redis-cli's):
  // a password then never needs to be in a command line, where `ps` shows it.
  static RedisEndpoint resolve(std::string_view url, const std::string& password_file);
  std::string str() const;  // the URL without the password, for logs
};

// `url` with the password (or a user@ that may be one) replaced by ***, for messages.
std::string redact_redis_url(std::string_view url);

// A reply copied out of hiredis's tree, so it owns its memory.
struct RedisReply {
  enum class Type { kNil, kString, kStatus, kInteger, kArray, kError };
  Type type = Type::kNil;
  std::string str;  // kString, kStatus, kError
  int64_t integer = 0;
  std::vector<RedisReply> elements;

  bool is_nil() const { return type == Type::kNil; }
  bool is_array() const { return type == Type::kArray; }
  size_t size() const { return elements.size(); }
  // Checked accessors: Error(kFailed) naming `what` when the reply has another shape.
  const std::string& as_string(std::string_view what) const;
  int64_t as_integer(std::string_view what) const;
  const RedisReply& at(size_t i, std::string_view what) const;
  std::string str_debug() const;  // for messages
};

// An error reply ("NOGROUP No such key ..."): prefix() is its first word.
class RedisError : public Error {
 public:
  explicit RedisError(const std::string& reply) : Error(ErrorKind::kFailed, reply) {}
  std::string prefix() const;
};

using RedisArgs = std::vector<std::string>;

class RedisConnection {
 public:
  // Connects, authenticates and selects the database within the deadline; throws
  // Error(kDisconnected) when the server cannot be reached, RedisError when it refuses.
  static RedisConnection open(const RedisEndpoint& endpoint, const Deadline& deadline);

  RedisConnection(RedisConnection&&) noexcept;
  RedisConnection& operator=(RedisConnection&&) noexcept;
  ~RedisConnection();

  // One command; an error reply throws RedisError. An I/O failure or the deadline throws
  // Error(kDisconnected) and leaves the connection broken (open a new one).
  RedisReply command(const RedisArgs& args, const Deadline& deadline);
  // Several commands in one round trip; every reply is returned, error replies included
  // (as kError). I/O failures throw as in command().
  std::vector<RedisReply> pipeline(std::span<const RedisArgs> commands, const Deadline& deadline);

  bool broken() const { return broken_; }
  const RedisEndpoint& endpoint() const { return endpoint_; }

 private:
  RedisConnection(redisContext* context, RedisEndpoint endpoint);
  void set_timeout(const Deadline& deadline);
  [[noreturn]] void fail_io(std::string_view doing);

  struct Free {
    void operator()(redisContext* c) const;
  };
  std::unique_ptr<redisContext, Free> context_;
  RedisEndpoint endpoint_;
  bool broken_ = false;
};

// A Lua script run by EVALSHA, loaded on first use and again after NOSCRIPT (a restarted
// server has forgotten it): the atomic steps of the queue (result + done mark + ack).
class RedisScript {
 public:
  explicit RedisScript(std::string source) : source_(std::move(source)) {}
  RedisReply run(RedisConnection& connection, const RedisArgs& keys, const RedisArgs& args,
                 const Deadline& deadline);

 private:
  std::string source_;
  std::string sha_;
};

}  // namespace strata
