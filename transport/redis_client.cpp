#include "transport/redis_client.h"

#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>

namespace strata {
namespace {

timeval to_timeval(double seconds) {
  // hiredis treats {0, 0} as "no timeout": the smallest wait is 1 ms.
  const double s = std::max(seconds, 0.001);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(s);
  tv.tv_usec = static_cast<suseconds_t>((s - std::floor(s)) * 1e6);
  return tv;
}

double remaining(const Deadline& deadline) {
  return std::chrono::duration<double>(deadline.at() - Deadline::Clock::now()).count();
}

RedisReply copy_reply(const redisReply* r) {
  RedisReply out;
  switch (r->type) {
    case REDIS_REPLY_STRING:
      out.type = RedisReply::Type::kString;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_STATUS:
      out.type = RedisReply::Type::kStatus;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_ERROR:
      out.type = RedisReply::Type::kError;
      out.str.assign(r->str, r->len);
      break;
    case REDIS_REPLY_INTEGER:
      out.type = RedisReply::Type::kInteger;
      out.integer = r->integer;
      break;
    case REDIS_REPLY_ARRAY:
      out.type = RedisReply::Type::kArray;
      out.elements.reserve(r->elements);
      for (size_t i = 0; i < r->elements; ++i) out.elements.push_back(copy_reply(r->element[i]));
      break;
    default:
      out.type = RedisReply::Type::kNil;
  }
  return out;
}

struct ReplyFree {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyFree>;

int parse_int(std::string_view text, std::string_view url, const char* part, int lo, int hi) {
  int v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v < lo || v > hi)
    fail_input("Redis URL '{}': {} must be an integer in [{}, {}], got '{}'", redact_redis_url(url),
               part, lo, hi, text);
  return v;
}

constexpr std::string_view kScheme = "redis://";
constexpr const char* kPasswordSources =
    "the URL (redis://USER:PASSWORD@host, or redis://:PASSWORD@host for a password alone), "
    "--redis-password-file FILE, STRATA_REDIS_PASSWORD or REDISCLI_AUTH";

// The first line of a password file: its contents are never printed.
std::string read_password_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_input("--redis-password-file {}: cannot read it: {}", path, std::strerror(errno));
  std::string text(4097, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > 4096) fail_input("--redis-password-file {}: over 4096 bytes", path);
  text = text.substr(0, text.find_first_of("\r\n"));
  if (text.empty()) fail_input("--redis-password-file {}: its first line is empty", path);
  return text;
}

}  // namespace

std::string redact_redis_url(std::string_view url) {
  const size_t start = url.substr(0, kScheme.size()) == kScheme ? kScheme.size() : 0;
  const size_t at = url.rfind('@');
  if (at == std::string_view::npos || at < start) return std::string(url);
  const std::string_view auth = url.substr(start, at - start);
  const size_t colon = auth.find(':');
  const std::string shown =
      colon == std::string_view::npos ? "***" : std::string(auth.substr(0, colon)) + ":***";
  return std::string(url.substr(0, start)) + shown + std::string(url.substr(at));
}

RedisEndpoint RedisEndpoint::parse(std::string_view url) {
  const std::string shown = redact_redis_url(url);
  if (url.substr(0, kScheme.size()) != kScheme)
    fail_input("Redis URL '{}' must start with redis:// (redis://[user:password@]host:port/db)",
               shown);
  RedisEndpoint e;
  std::string_view rest = url.substr(kScheme.size());
  if (const size_t at = rest.rfind('@'); at != std::string_view::npos) {
    const std::string_view auth = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const size_t colon = auth.find(':');
    // user@host: its password comes from elsewhere (resolve).
    e.user = std::string(auth.substr(0, colon));  // empty in redis://:password@host
    if (colon != std::string_view::npos) e.password = std::string(auth.substr(colon + 1));
  }
  if (const size_t slash = rest.find('/'); slash != std::string_view::npos) {
    const std::string_view db = rest.substr(slash + 1);
    if (!db.empty()) e.db = parse_int(db, url, "the database number", 0, 1 << 20);
    rest = rest.substr(0, slash);
  }
  if (const size_t colon = rest.rfind(':'); colon != std::string_view::npos) {
    e.port = parse_int(rest.substr(colon + 1), url, "the port", 1, 65535);
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) fail_input("Redis URL '{}' names no host", shown);
  e.host = std::string(rest);
  return e;
}

RedisEndpoint RedisEndpoint::resolve(std::string_view url, const std::string& password_file) {
  RedisEndpoint e = parse(url);
  if (!e.password.empty() && !password_file.empty())
    fail_input("Redis URL '{}' has a password and --redis-password-file {} another: give one",
               redact_redis_url(url), password_file);
  if (e.password.empty() && !password_file.empty()) e.password = read_password_file(password_file);
  for (const char* var : {"STRATA_REDIS_PASSWORD", "REDISCLI_AUTH"}) {
    const char* v = std::getenv(var);
    if (e.password.empty() && v != nullptr) e.password = v;
  }
  if (e.password.empty() && !e.user.empty())
    fail_input("Redis URL '{}' names a user but no password: give it in {}", redact_redis_url(url),
               kPasswordSources);
  return e;
}

std::string RedisEndpoint::str() const {
  const std::string auth = password.empty() ? "" : user + ":***@";
  return fmt::format("redis://{}{}:{}/{}", auth, host, port, db);
}

const std::string& RedisReply::as_string(std::string_view what) const {
  if (type != Type::kString && type != Type::kStatus)
    fail(ErrorKind::kFailed, "Redis: {}: expected a string, got {}", what, str_debug());
  return str;
}

int64_t RedisReply::as_integer(std::string_view what) const {
  if (type == Type::kInteger) return integer;
  int64_t v = 0;
  if (type == Type::kString) {
    const auto [end, ec] = std::from_chars(str.data(), str.data() + str.size(), v);
    if (ec == std::errc() && end == str.data() + str.size()) return v;
  }
  fail(ErrorKind::kFailed, "Redis: {}: expected an integer, got {}", what, str_debug());
}

const RedisReply& RedisReply::at(size_t i, std::string_view what) const {
  if (type != Type::kArray || i >= elements.size())
    fail(ErrorKind::kFailed, "Redis: {}: expected an array of more than {} elements, got {}", what,
         i, str_debug());
  return elements[i];
}

std::string RedisReply::str_debug() const {
  switch (type) {
    case Type::kNil:
      return "nil";
    case Type::kInteger:
      return fmt::format("integer {}", integer);
    case Type::kArray:
      return fmt::format("array of {}", elements.size());
    case Type::kError:
      return fmt::format("error '{}'", str);
    default:
      return fmt::format("'{}'", str.substr(0, 80));
  }
}

std::string RedisError::prefix() const {
  const std::string_view w = what();
  return std::string(w.substr(0, w.find(' ')));
}

void RedisConnection::Free::operator()(redisContext* c) const {
  redisFree(c);
}

RedisConnection::RedisConnection(redisContext* context, RedisEndpoint endpoint)
    : context_(context), endpoint_(std::move(endpoint)) {}
RedisConnection::RedisConnection(RedisConnection&&) noexcept = default;
RedisConnection& RedisConnection::operator=(RedisConnection&&) noexcept = default;
RedisConnection::~RedisConnection() = default;

RedisConnection RedisConnection::open(const RedisEndpoint& e, const Deadline& deadline) {
  redisContext* raw =
      redisConnectWithTimeout(e.host.c_str(), e.port, to_timeval(remaining(deadline)));
  if (raw == nullptr)
    fail(ErrorKind::kDisconnected, "Redis {}: cannot allocate a connection", e.str());
  RedisConnection c(raw, e);
  if (raw->err != 0)
    fail(ErrorKind::kDisconnected, "Redis {}: cannot connect: {}", e.str(), raw->errstr);
  // Authenticated (or found not to need it) before any other command: a server with a
  // password answers an unauthenticated command with NOAUTH, or a large one by closing with
  // "Protocol error: unauthenticated ...", neither of which says what to do.
  RedisArgs first{"PING"};
  if (!e.password.empty()) {
    first = {"AUTH"};
    if (!e.user.empty()) first.push_back(e.user);
    first.push_back(e.password);
  }
  try {
    c.command(first, deadline);
  } catch (const RedisError& err) {
    const std::string p = err.prefix();
    if (e.password.empty() && p == "NOAUTH")
      throw RedisError(
          fmt::format("NOAUTH Redis {} requires a password and none was given: give it in {}",
                      e.str(), kPasswordSources));
    if (!e.password.empty() && (p == "WRONGPASS" || p == "ERR"))
      throw RedisError(fmt::format("WRONGPASS Redis {}: authentication{} failed: {}", e.str(),
                                   e.user.empty() ? "" : " as user '" + e.user + "'", err.what()));
    throw;
  }
  if (e.db != 0) c.command({"SELECT", std::to_string(e.db)}, deadline);
  return c;
}

void RedisConnection::set_timeout(const Deadline& deadline) {
  if (broken_) fail(ErrorKind::kDisconnected, "Redis {}: the connection was lost", endpoint_.str());
  const double left = remaining(deadline);
  if (left <= 0)
    fail(ErrorKind::kDisconnected, "Redis {}: deadline passed before the command", endpoint_.str());
  if (redisSetTimeout(context_.get(), to_timeval(left)) != REDIS_OK) fail_io("setting the timeout");
}

void RedisConnection::fail_io(std::string_view doing) {
  broken_ = true;
  const redisContext* c = context_.get();
  // hiredis reports a socket timeout as an I/O error with strerror(EAGAIN).
  const bool timeout =
      c->err == REDIS_ERR_IO && std::string_view(c->errstr) == std::strerror(EAGAIN);
  fail(ErrorKind::kDisconnected, "Redis {}: {}: {}", endpoint_.str(), doing,
       timeout ? std::string("no answer before the deadline") : std::string(c->errstr));
}

RedisReply RedisConnection::command(const RedisArgs& args, const Deadline& deadline) {
  std::vector<RedisReply> replies = pipeline(std::span(&args, 1), deadline);
  if (replies[0].type == RedisReply::Type::kError) throw RedisError(replies[0].str);
  return std::move(replies[0]);
}

std::vector<RedisReply> RedisConnection::pipeline(std::span<const RedisArgs> commands,
                                                  const Deadline& deadline) {
  set_timeout(deadline);
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const RedisArgs& args : commands) {
    argv.clear();
    lens.clear();
    for (const std::string& a : args) {
      argv.push_back(a.data());
      lens.push_back(a.size());
    }
    if (redisAppendCommandArgv(context_.get(), static_cast<int>(argv.size()), argv.data(),
                               lens.data()) != REDIS_OK)
      fail_io("sending a command");
  }
  std::vector<RedisReply> replies;
  replies.reserve(commands.size());
  for (size_t i = 0; i < commands.size(); ++i) {
    void* raw = nullptr;
    if (redisGetReply(context_.get(), &raw) != REDIS_OK || raw == nullptr)
      fail_io(commands[i].empty() ? "reading a reply" : "reading the reply to " + commands[i][0]);
    const ReplyPtr reply(static_cast<redisReply*>(raw));
    replies.push_back(copy_reply(reply.get()));
  }
  return replies;
}

RedisReply RedisScript::run(RedisConnection& connection, const RedisArgs& keys,
                            const RedisArgs& args, const Deadline& deadline) {
  auto call = [&](const char* verb, const std::string& body) {
    RedisArgs argv{verb, body, std::to_string(keys.size())};
    argv.insert(argv.end(), keys.begin(), keys.end());
    argv.insert(argv.end(), args.begin(), args.end());
    return connection.command(argv, deadline);
  };
  if (sha_.empty())
    sha_ = connection.command({"SCRIPT", "LOAD", source_}, deadline).as_string("SCRIPT LOAD");
  try {
    return call("EVALSHA", sha_);
  } catch (const RedisError& e) {
    if (e.prefix() != "NOSCRIPT") throw;
  }
  return call("EVAL", source_);  // the server restarted and forgot it; EVAL caches it again
}

}  // namespace strata
