// The Redis client against a real redis-server: URLs, commands and pipelines, error replies
// with their prefix, deadlines that end a command the server does not answer, a server
// that is gone, authentication and database selection, scripts reloaded after NOSCRIPT.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>

#include "kernels/clock.h"
#include "support/redis_server.h"
#include "support/scoped_variable.h"
#include "transport/redis_client.h"

namespace strata {
namespace {

using testing::RedisServer;

std::string tmp(const std::string& name) {
  return std::string(STRATA_TEST_TMP) + "/" + name;
}

TEST(RedisEndpoint, ParsesEveryPart) {
  const RedisEndpoint e = RedisEndpoint::parse("redis://alice:s3cret@db.example:6390/4");
  EXPECT_EQ(e.host, "db.example");
  EXPECT_EQ(e.port, 6390);
  EXPECT_EQ(e.user, "alice");
  EXPECT_EQ(e.password, "s3cret");
  EXPECT_EQ(e.db, 4);
  EXPECT_EQ(e.str(), "redis://alice:***@db.example:6390/4");  // no password in logs
  const RedisEndpoint d = RedisEndpoint::parse("redis://localhost");
  EXPECT_EQ(d.port, 6379);
  EXPECT_EQ(d.db, 0);
  EXPECT_EQ(RedisEndpoint::parse("redis://:pw@h:1").password, "pw");
}

TEST(RedisEndpoint, RefusesWhatIsWrongNamingThePart) {
  const std::pair<const char*, const char*> cases[] = {
      {"http://h:1", "must start with redis://"},
      {"redis://h:0", "the port"},
      {"redis://h:99999", "the port"},
      {"redis://h:x", "the port"},
      {"redis://h:1/db", "the database number"},
      {"redis://:1", "names no host"},
  };
  for (const auto& [url, want] : cases) {
    try {
      RedisEndpoint::parse(url);
      ADD_FAILURE() << url << " accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << url << ": " << e.what();
    }
  }
}

TEST(RedisEndpoint, MessagesNeverShowThePassword) {
  EXPECT_EQ(redact_redis_url("redis://alice:pw@h:1/2"), "redis://alice:***@h:1/2");
  EXPECT_EQ(redact_redis_url("redis://:p@ss@h"), "redis://:***@h");
  EXPECT_EQ(redact_redis_url("redis://pw@h"), "redis://***@h");  // may be a password
  EXPECT_EQ(redact_redis_url("redis://h:1"), "redis://h:1");
  for (const char* url :
       {"redis://:pw123@h:99999", "redis://u:pw123@h:1/x", "redis://:pw123@", "http://:pw123@h"}) {
    try {
      RedisEndpoint::parse(url);
      ADD_FAILURE() << url << " accepted";
    } catch (const InputError& e) {
      EXPECT_EQ(std::string(e.what()).find("pw123"), std::string::npos) << e.what();
    }
  }
}

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::optional<std::string>(v) : std::nullopt;
}

TEST(RedisEndpoint, PasswordFromTheUrlAFileOrTheEnvironment) {
  testing::ScopedVariable strata_pw("STRATA_REDIS_PASSWORD", nullptr, env("STRATA_REDIS_PASSWORD"));
  testing::ScopedVariable cli_pw("REDISCLI_AUTH", nullptr, env("REDISCLI_AUTH"));
  // A user without a password anywhere: refused, the user not shown (it may be a password).
  try {
    RedisEndpoint::resolve("redis://pw123@h", "");
    ADD_FAILURE() << "a user without a password was accepted";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("names a user but no password"), std::string::npos);
    EXPECT_EQ(std::string(e.what()).find("pw123"), std::string::npos) << e.what();
  }
  std::filesystem::create_directories(STRATA_TEST_TMP);
  const std::string file = tmp("redis_password");
  std::ofstream(file) << "from-file\nsecond line\n";
  ASSERT_TRUE(std::filesystem::exists(file)) << file;
  EXPECT_EQ(RedisEndpoint::resolve("redis://bob@h", file).password, "from-file");
  EXPECT_EQ(RedisEndpoint::resolve("redis://bob@h", file).user, "bob");
  EXPECT_THROW(RedisEndpoint::resolve("redis://:x@h", file), InputError);  // two passwords
  EXPECT_THROW(RedisEndpoint::resolve("redis://h", tmp("no_such_file")), InputError);
  {
    testing::ScopedVariable cli("REDISCLI_AUTH", "from-cli", env("REDISCLI_AUTH"));
    EXPECT_EQ(RedisEndpoint::resolve("redis://h", "").password, "from-cli");
    testing::ScopedVariable ours("STRATA_REDIS_PASSWORD", "from-strata",
                                 env("STRATA_REDIS_PASSWORD"));
    EXPECT_EQ(RedisEndpoint::resolve("redis://h", "").password, "from-strata");
    EXPECT_EQ(RedisEndpoint::resolve("redis://:url@h", "").password, "url");
    EXPECT_EQ(RedisEndpoint::resolve("redis://h", file).password, "from-file");
  }
  EXPECT_EQ(RedisEndpoint::resolve("redis://h", "").password, "");
}

TEST(RedisClient, CommandsPipelinesAndErrorReplies) {
  RedisServer server(tmp("redis_client_cmd"));
  RedisConnection c = server.connect();
  const Deadline d = Deadline::after_seconds(5);
  EXPECT_EQ(c.command({"SET", "k", std::string("a\0b", 3)}, d).str, "OK");
  EXPECT_EQ(c.command({"GET", "k"}, d).str, std::string("a\0b", 3));  // binary safe
  EXPECT_TRUE(c.command({"GET", "missing"}, d).is_nil());
  const std::vector<RedisArgs> batch = {{"INCR", "n"}, {"INCR", "n"}, {"LPUSH", "k", "x"}};
  const std::vector<RedisReply> r = c.pipeline(batch, d);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].integer, 1);
  EXPECT_EQ(r[1].integer, 2);
  EXPECT_EQ(r[2].type, RedisReply::Type::kError);  // an error reply stays in its place
  EXPECT_EQ(r[2].str.substr(0, 9), "WRONGTYPE");
  try {
    c.command({"XGROUP", "CREATE", "nostream", "g", "0"}, d);
    ADD_FAILURE() << "XGROUP on a missing stream succeeded";
  } catch (const RedisError& e) {
    EXPECT_EQ(e.prefix(), "ERR");
    EXPECT_EQ(e.kind(), ErrorKind::kFailed);
  }
  EXPECT_FALSE(c.broken());  // an error reply leaves the connection usable
  EXPECT_EQ(c.command({"GET", "n"}, d).as_integer("n"), 2);
}

TEST(RedisClient, ADeadlineEndsACommandTheServerHoldsAndBreaksTheConnection) {
  RedisServer server(tmp("redis_client_deadline"));
  RedisConnection c = server.connect();
  const auto start = std::chrono::steady_clock::now();
  try {
    c.command({"BLPOP", "never", "10"}, Deadline::after_seconds(0.3));
    ADD_FAILURE() << "BLPOP returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDisconnected);
    EXPECT_NE(std::string(e.what()).find("no answer before the deadline"), std::string::npos)
        << e.what();
  }
  const double took = seconds_since(start);
  EXPECT_LT(took, 2.0);
  EXPECT_TRUE(c.broken());
  EXPECT_THROW(c.command({"PING"}, Deadline::after_seconds(1)), Error);
}

TEST(RedisClient, AServerThatIsGoneIsDisconnectedNamingIt) {
  auto server = std::make_unique<RedisServer>(tmp("redis_client_gone"));
  RedisConnection c = server->connect();
  const RedisEndpoint endpoint = server->endpoint();
  server.reset();  // SIGKILL
  try {
    c.command({"PING"}, Deadline::after_seconds(2));
    ADD_FAILURE() << "PING to a dead server";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDisconnected);
  }
  try {
    RedisConnection::open(endpoint, Deadline::after_seconds(2));
    ADD_FAILURE() << "connected to a dead server";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kDisconnected);
    EXPECT_NE(std::string(e.what()).find(endpoint.str()), std::string::npos) << e.what();
  }
}

TEST(RedisClient, AuthenticatesAndSelectsTheDatabase) {
  RedisServer server(tmp("redis_client_auth"), {"--requirepass", "pw"});
  const std::string base = "127.0.0.1:" + std::to_string(server.port());
  RedisConnection c = RedisConnection::open(RedisEndpoint::parse("redis://:pw@" + base + "/3"),
                                            Deadline::after_seconds(5));
  const Deadline d = Deadline::after_seconds(5);
  c.command({"SET", "in3", "x"}, d);
  EXPECT_EQ(c.command({"CLIENT", "INFO"}, d).str.find("db=3") != std::string::npos, true);
  try {
    RedisConnection::open(RedisEndpoint::parse("redis://:wrong@" + base), d);
    ADD_FAILURE() << "a wrong password was accepted";
  } catch (const RedisError& e) {
    EXPECT_EQ(e.prefix(), "WRONGPASS");
    EXPECT_NE(std::string(e.what()).find("authentication failed"), std::string::npos);
    EXPECT_EQ(std::string(e.what()).find("wrong"), std::string::npos) << e.what();
  }
  try {
    RedisConnection::open(RedisEndpoint::parse("redis://" + base), d);
    ADD_FAILURE() << "no password was accepted";
  } catch (const RedisError& e) {
    EXPECT_EQ(e.prefix(), "NOAUTH");
    EXPECT_NE(std::string(e.what()).find("requires a password"), std::string::npos) << e.what();
  }
}

TEST(RedisClient, ScriptsRunAndSurviveAServerThatForgotThem) {
  RedisServer server(tmp("redis_client_script"));
  RedisConnection c = server.connect();
  const Deadline d = Deadline::after_seconds(5);
  RedisScript add("return redis.call('INCRBY', KEYS[1], ARGV[1])");
  EXPECT_EQ(add.run(c, {"x"}, {"5"}, d).integer, 5);
  c.command({"SCRIPT", "FLUSH"}, d);  // as after a restart: EVALSHA answers NOSCRIPT
  EXPECT_EQ(add.run(c, {"x"}, {"2"}, d).integer, 7);
}

}  // namespace
}  // namespace strata
