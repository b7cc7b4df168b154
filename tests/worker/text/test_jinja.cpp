// The Jinja subset, construct by construct. Expected strings are worked out by hand from
// jinja2's documented behaviour (with trim_blocks and lstrip_blocks on, as transformers
// renders chat templates); test_chat_template compares against jinja2 itself.
#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "kernels/error.h"
#include "worker/text/jinja.h"

namespace strata::jinja {
namespace {

using nlohmann::json;

std::string render(const std::string& tmpl, const json& ctx = json::object()) {
  return Template::parse(tmpl, "t").render(ctx);
}

// The InputError a template produces, parsing or rendering; "" if none.
std::string error_of(const std::string& tmpl, const json& ctx = json::object()) {
  try {
    render(tmpl, ctx);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(Jinja, TextExpressionsAndComments) {
  EXPECT_EQ(render("plain text"), "plain text");
  EXPECT_EQ(render("a{{ 1 }}b{# gone #}c"), "a1bc");
  EXPECT_EQ(render("{{ x }}", {{"x", "v"}}), "v");
  EXPECT_EQ(render("{ not a tag } {x}"), "{ not a tag } {x}");
  EXPECT_EQ(render("{{ {'a': {'b': 1}} }}"), "{'a': {'b': 1}}");  // "}}" inside braces
}

TEST(Jinja, WhitespaceControl) {
  EXPECT_EQ(render("a  {{- 1 -}}  b"), "a1b");
  EXPECT_EQ(render("a \n {%- if true -%} \n b {%- endif %}"), "ab");
  EXPECT_EQ(render("a\n  {#- c -#}\n  b"), "ab");
  // trim_blocks: the newline after a block tag goes; after an expression it stays.
  EXPECT_EQ(render("{% if true %}\nx\n{% endif %}\ny"), "x\ny");
  EXPECT_EQ(render("{{ 1 }}\n2"), "1\n2");
  // lstrip_blocks: indentation before a block or comment tag at line start goes...
  EXPECT_EQ(render("a\n    {% if true %}\n    b\n    {% endif %}\nc"), "a\n    b\nc");
  EXPECT_EQ(render("  {# c #}\nx"), "x");
  // ...but not before an expression, nor when text precedes the tag on its line.
  EXPECT_EQ(render("a\n  {{ 1 }}"), "a\n  1");
  EXPECT_EQ(render("a x  {% if true %}b{% endif %}"), "a x  b");
  // `+` keeps what lstrip_blocks / trim_blocks would remove.
  EXPECT_EQ(render("  {%+ if true %}b{% endif %}"), "  b");
  EXPECT_EQ(render("{% if true +%}\nb{% endif %}"), "\nb");
  // One trailing newline of the template is dropped; \r\n becomes \n.
  EXPECT_EQ(render("a\r\nb\n"), "a\nb");
  EXPECT_EQ(render("a\n\n"), "a\n");
  EXPECT_EQ(render("{% raw %}{{ x }}{% if %}{% endraw %}"), "{{ x }}{% if %}");
}

TEST(Jinja, Literals) {
  EXPECT_EQ(render("{{ 'a\\nb' }}|{{ \"it's\" }}|{{ 'x' \"y\" }}"), "a\nb|it's|xy");
  EXPECT_EQ(render("{{ '\\u00e9\\x41\\t' }}"),
            "\xc3\xa9"
            "A\t");
  EXPECT_EQ(render("{{ 'keep\\q' }}"), "keep\\q");
  EXPECT_EQ(render("{{ 42 }} {{ -3 }} {{ 1_000 }} {{ 2.50 }} {{ 1e3 }} {{ 1e-5 }} {{ 1e16 }}"),
            "42 -3 1000 2.5 1000.0 1e-05 1e+16");
  EXPECT_EQ(render("{{ true }} {{ False }} {{ none }} {{ None }}"), "True False None None");
  EXPECT_EQ(render("{{ [1, 'a', none] }} {{ {'k': [true]} }} {{ (1,) }} {{ (1, 2) }} {{ [] }}"),
            "[1, 'a', None] {'k': [True]} (1,) (1, 2) []");
  EXPECT_EQ(render("{{ [\"it's\", 'q\"', 'b\\\\'] }}"), "[\"it's\", 'q\"', 'b\\\\']");
}

TEST(Jinja, Operators) {
  EXPECT_EQ(render("{{ 1 + 2 * 3 }} {{ (1 + 2) * 3 }} {{ 7 - 10 }} {{ 2 ** 3 ** 2 }}"),
            "7 9 -3 64");
  EXPECT_EQ(render("{{ 7 / 2 }} {{ 4 / 2 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }}"),
            "3.5 2.0 3 -4 2 -2");
  EXPECT_EQ(render("{{ 'a' ~ 1 ~ none ~ undefined_var ~ [1] }}"), "a1None[1]");
  EXPECT_EQ(render("{{ 'ab' + 'cd' }} {{ [1] + [2] }} {{ 'ab' * 2 }} {{ 0.5 + 1 }} {{ true + 1 }}"),
            "abcd [1, 2] abab 1.5 2");
  EXPECT_EQ(render("{{ 1 < 2 }} {{ 2 <= 1 }} {{ 1 == 1.0 }} {{ 'a' != 'b' }} {{ 1 < 2 < 3 }} {{ 3 "
                   "> 2 > 2 }}"),
            "True False True True True False");
  EXPECT_EQ(
      render("{{ 'ell' in 'hello' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [3] }}"),
      "True True True False");
  EXPECT_EQ(render("{{ 0 or 'x' }} {{ 2 and 'y' }} {{ [] or '' }}|{{ not 0 }} {{ not not 'a' }}"),
            "x y |True True");
  EXPECT_EQ(render("{{ 'y' if 1 else 'n' }} {{ 'y' if 0 else 'n' }} [{{ 'y' if 0 }}] {{ 'a' if 0 "
                   "else 'b' if 1 else 'c' }}"),
            "y n [] b");
  // Filters bind tighter than arithmetic.
  EXPECT_EQ(render("{{ 'x' + ' a '|trim + 'y' }} {{ [1, 2]|length - 1 }} {{ -3|abs }}"), "xay 1 3");
}

TEST(Jinja, SubscriptsSlicesAttributes) {
  const json ctx = {
      {"l", {1, 2, 3, 4}}, {"m", {{"role", "user"}, {"items", 5}}}, {"s", "h\xc3\xa9llo"}};
  EXPECT_EQ(
      render(
          "{{ l[0] }} {{ l[-1] }} {{ l[1:3] }} {{ l[:2] }} {{ l[2:] }} {{ l[::-1] }} {{ l[::2] }}",
          ctx),
      "1 4 [2, 3] [1, 2] [3, 4] [4, 3, 2, 1] [1, 3]");
  EXPECT_EQ(render("{{ l[10:] }} {{ l[-100:1] }} [{{ l[9] }}]", ctx), "[] [1] []");
  EXPECT_EQ(render("{{ s[1] }} {{ s[1:3] }} {{ s[::-1] }} {{ s|length }}", ctx),
            "\xc3\xa9 \xc3\xa9l oll\xc3\xa9h 5");
  EXPECT_EQ(render("{{ m.role }} {{ m['role'] }} {{ m['items'] }} {{ l.0 }}", ctx),
            "user user 5 1");
  EXPECT_EQ(
      render("[{{ m.missing }}] {{ m.missing is defined }} [{{ none.x }}] [{{ s.nope }}]", ctx),
      "[] False [] []");
  // nlohmann::json sorts keys; ordered_json keeps them as Python would.
  EXPECT_EQ(render("{{ m.items()|list }}", ctx), "[('items', 5), ('role', 'user')]");
  const auto ordered = nlohmann::ordered_json::parse(R"({"m": {"role": "user", "items": 5}})");
  EXPECT_EQ(Template::parse("{{ m.items()|list }} {{ m|list }}", "t").render_ordered(ordered),
            "[('role', 'user'), ('items', 5)] ['role', 'items']");
}

TEST(Jinja, UndefinedBehavesLikeJinja2Default) {
  EXPECT_EQ(render("[{{ nope }}] {{ nope is defined }} {{ nope is undefined }} {{ not nope }} {{ "
                   "nope|length }}"),
            "[] False True True 0");
  EXPECT_EQ(render("{% for x in nope %}x{% else %}empty{% endfor %} {{ nope|default('d') }} {{ "
                   "nope == nope }}"),
            "empty d True");
  EXPECT_EQ(error_of("{{ nope.attr }}"), "t line 1: 'nope' is undefined");
  EXPECT_EQ(error_of("\n{{ nope + 1 }}"), "t line 2: 'nope' is undefined");
  EXPECT_EQ(error_of("{{ m.a.b }}", {{"m", json::object()}}),
            "t line 1: 'dict object' has no attribute 'a'");
  EXPECT_EQ(error_of("{{ [][0].role }}"), "t line 1: 'list object' has no element 0");
}

TEST(Jinja, IfElifElse) {
  const std::string t =
      "{% if n == 1 %}one{% elif n == 2 %}two{% elif n > 5 %}big{% else %}other{% endif %}";
  EXPECT_EQ(render(t, {{"n", 1}}), "one");
  EXPECT_EQ(render(t, {{"n", 2}}), "two");
  EXPECT_EQ(render(t, {{"n", 9}}), "big");
  EXPECT_EQ(render(t, {{"n", 4}}), "other");
  EXPECT_EQ(render("{% if '' %}a{% endif %}{% if [0] %}b{% endif %}{% if {} %}c{% endif %}{% if "
                   "0.0 %}d{% endif %}"),
            "b");
}

TEST(Jinja, ForLoops) {
  EXPECT_EQ(render("{% for x in [5, 6, 7] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ "
                   "loop.revindex0 }}"
                   "{{ loop.first }}{{ loop.last }}{{ loop.length }} {% endfor %}"),
            "1032TrueFalse3 2121FalseFalse3 3210FalseTrue3 ");
  EXPECT_EQ(render("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}:{{ loop.index }}/{{ "
                   "loop.length }} {% endfor %}"),
            "2:1/2 4:2/2 ");
  EXPECT_EQ(render("{% for x in [] %}x{% else %}none{% endfor %}"), "none");
  EXPECT_EQ(render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                   {{"d", {{"a", 1}, {"b", 2}}}}),
            "a=1;b=2;");
  EXPECT_EQ(render("{% for k in d %}{{ k }}{% endfor %}", {{"d", {{"a", 1}, {"b", 2}}}}), "ab");
  EXPECT_EQ(render("{% for c in 'ab' %}[{{ c }}]{% endfor %}"), "[a][b]");
  EXPECT_EQ(render("{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == "
                   "4 %}{% break %}{% endif %}{{ x }}{% endfor %}"),
            "13");
  EXPECT_EQ(render("{% for x in [1, 2, 3] %}{{ loop.previtem }}{{ loop.nextitem }}{{ "
                   "loop.cycle('a', 'b') }},{% endfor %}"),
            "2a,13b,2a,");
  EXPECT_EQ(render("{% for a in 'xy' %}{% for b in 'z' %}{{ a }}{{ b }}{{ loop.index }}{% endfor "
                   "%}{{ loop.index }} {% endfor %}"),
            "xz11 yz12 ");
}

TEST(Jinja, SetScopingAndNamespaces) {
  // A loop body has its own scope, fresh every iteration; `if` does not.
  EXPECT_EQ(
      render(
          "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = 5 %}{{ x }}{% endfor %}{{ x }}"),
      "15151");
  EXPECT_EQ(render("{% if true %}{% set y = 2 %}{% endif %}{{ y }}"), "2");
  EXPECT_EQ(render("{% set ns = namespace(n=0, seen=false) %}{% for i in [1, 2, 3] %}{% set ns.n = "
                   "ns.n + i %}{% endfor %}"
                   "{% set ns.seen = true %}{{ ns.n }} {{ ns.seen }}"),
            "6 True");
  EXPECT_EQ(render("{% set a, b = [1, 2] %}{{ b }}{{ a }} {% set t = 1, 2 %}{{ t }}"), "21 (1, 2)");
  EXPECT_EQ(render("{% set body %}x{{ 1 + 1 }}{% endset %}[{{ body }}]"), "[x2]");
  EXPECT_EQ(error_of("{% set s = 'x' %}{% set s.a = 1 %}"),
            "t line 1: cannot assign attribute on non-namespace object 's'");
}

TEST(Jinja, Macros) {
  EXPECT_EQ(render("{% macro m(a, b='B') %}<{{ a }}{{ b }}>{% endmacro %}{{ m(1) }}{{ m(1, 2) }}{{ "
                   "m(b=3, a=4) }}[{{ m() }}]"),
            "<1B><12><43>[<B>]");
  EXPECT_EQ(render("{% set top = 'T' %}{% macro m() %}{{ top }}{% endmacro %}{% for i in [1] %}{% "
                   "set inner = 'I' %}{{ m() }}{% endfor %}"),
            "T");
  EXPECT_EQ(error_of("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"),
            "t line 1: macro 'm' takes 1 arguments (2 given)");
}

TEST(Jinja, Filters) {
  EXPECT_EQ(render("[{{ '  a b \n'|trim }}] [{{ 'xxaxx'|trim('x') }}] {{ 'abc'|length }} {{ [1, "
                   "2]|count }}"),
            "[a b] [a] 3 2");
  EXPECT_EQ(render("{{ 'aBc'|upper }} {{ 'aBc'|lower }} {{ 'hELLO wORLD'|capitalize }} {{ 'hello "
                   "big-world'|title }}"),
            "ABC abc Hello world Hello Big-World");
  EXPECT_EQ(render("{{ 'a-b-c'|replace('-', '+') }} {{ 'a-b-c'|replace('-', '', 1) }}"),
            "a+b+c ab-c");
  EXPECT_EQ(render("{{ x|default('d') }} {{ ''|default('d') }} {{ ''|default('d', true) }} {{ "
                   "0|d(5, true) }}"),
            "d  d 5");
  EXPECT_EQ(render("{{ [3, 4]|first }} {{ [3, 4]|last }} {{ 'xy'|first }} {{ [1, 2]|join }} {{ [1, "
                   "2]|join(', ') }}"),
            "3 4 x 12 1, 2");
  EXPECT_EQ(render("{{ 'ab'|list }} {{ 5|string ~ '!' }} {{ [1]|safe }} {{ '7'|int + 1 }} {{ "
                   "'7.9'|int }} {{ 'x'|int }} {{ '1.5'|float }}"),
            "['a', 'b'] 5! [1] 8 7 0 1.5");
  EXPECT_EQ(render("{{ -2|abs }} {{ 2.5|round }} {{ 3.5|round }} {{ 1.234|round(2) }} {{ "
                   "1.2|round(0, 'ceil') }}"),
            "2 2.0 4.0 1.23 2.0");
  EXPECT_EQ(render("{{ {'b': 1, 'a': 2}|items|list }} {{ {'b': 1, 'a': 2}|dictsort }}"),
            "[('b', 1), ('a', 2)] [('a', 2), ('b', 1)]");
  EXPECT_EQ(render("{{ ['b', 'A', 'c']|sort }} {{ [3, 1, 2]|sort(reverse=true) }} {{ [1, "
                   "2]|reverse|list }} {{ 'ab'|reverse }}"),
            "['A', 'b', 'c'] [3, 2, 1] [2, 1] ba");
  EXPECT_EQ(render("{{ ['a', 'A', 'b']|unique|list }} {{ [1, 2, 3, 4]|select('odd')|list }} {{ [1, "
                   "2, 3]|reject('odd')|list }}"),
            "['a', 'b'] [1, 3] [2]");
  const json people = {
      {"p", {{{"n", "x"}, {"ok", true}, {"age", 3}}, {{"n", "y"}, {"ok", false}, {"age", 1}}}}};
  EXPECT_EQ(render("{{ p|selectattr('ok')|map(attribute='n')|list }} {{ "
                   "p|rejectattr('ok')|map(attribute='n')|join }} "
                   "{{ p|selectattr('age', 'lt', 2)|map(attribute='n')|first }} {{ "
                   "p|sort(attribute='age')|map(attribute='n')|join }}",
                   people),
            "['x'] y y yx");
  EXPECT_EQ(render("{{ ['a', 'b']|map('upper')|join }}"), "AB");
  EXPECT_EQ(render("{{ 'a\nb\n\nc'|indent(2) }}|{{ 'a\nb'|indent(first=true) }}"),
            "a\n  b\n\n  c|    a\n    b");
}

TEST(Jinja, TojsonFollowsTransformers) {
  const auto ctx = nlohmann::ordered_json::parse(
      R"({"d": {"b": 1, "a": [true, null, 1.5, "<&>'"], "u": "\u00e9\n\"\\"}})");
  // Keys in their order, no HTML escaping, non-ASCII kept, Python's separators.
  EXPECT_EQ(Template::parse("{{ d|tojson }}", "t").render_ordered(ctx),
            "{\"b\": 1, \"a\": [true, null, 1.5, \"<&>'\"], \"u\": \"\xc3\xa9\\n\\\"\\\\\"}");
  EXPECT_EQ(render("{{ [1, {'k': []}]|tojson(indent=2) }}"), "[\n  1,\n  {\n    \"k\": []\n  }\n]");
  EXPECT_EQ(
      render("{{ {'b': 1, 'a': 2}|tojson(sort_keys=true) }} {{ 'é'|tojson(ensure_ascii=true) }}"),
      "{\"a\": 2, \"b\": 1} \"\\u00e9\"");
  EXPECT_EQ(render("{{ {'a': [1, 2]}|tojson(separators=(',', ':')) }} {{ 'x'|tojson }} {{ "
                   "2.0|tojson }} {{ none|tojson }}"),
            "{\"a\":[1,2]} \"x\" 2.0 null");
  EXPECT_NE(error_of("{{ nope|tojson }}").find("not JSON serializable"), std::string::npos);
}

TEST(Jinja, Tests) {
  const json ctx = {{"n", 7},      {"f", 1.5}, {"s", "x"}, {"l", {1}}, {"d", json::object()},
                    {"z", nullptr}};
  EXPECT_EQ(render("{{ n is defined }} {{ q is defined }} {{ z is none }} {{ n is not none }} {{ s "
                   "is string }} {{ n is string }}",
                   ctx),
            "True False True True True False");
  EXPECT_EQ(render("{{ n is number }} {{ f is number }} {{ n is integer }} {{ f is float }} {{ "
                   "true is boolean }} {{ 0 is false }} {{ false is false }}",
                   ctx),
            "True True True True True False True");
  EXPECT_EQ(render("{{ d is mapping }} {{ l is mapping }} {{ l is iterable }} {{ s is sequence }} "
                   "{{ n is iterable }}",
                   ctx),
            "True False True True False");
  EXPECT_EQ(render("{{ n is odd }} {{ n is even }} {{ 9 is divisibleby 3 }} {{ n is eq 7 }} {{ n "
                   "is gt(8) }} {{ 1 is in l }}",
                   ctx),
            "True False True True False True");
}

TEST(Jinja, Methods) {
  EXPECT_EQ(render("[{{ ' a '.strip() }}][{{ ' a '.lstrip() }}][{{ ' a '.rstrip() }}][{{ "
                   "'\n\nx\n'.strip('\n') }}]"),
            "[a][a ][ a][x]");
  EXPECT_EQ(render("{{ 'a,b'.split(',') }} {{ ' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ "
                   "'a b c'.rsplit(' ', 1) }}"),
            "['a', 'b'] ['a', 'b'] ['a', 'b c'] ['a b', 'c']");
  EXPECT_EQ(render("{{ 'abc'.startswith('ab') }} {{ 'abc'.endswith('bc') }} {{ "
                   "'abc'.startswith(('x', 'a')) }} {{ 'abc'.endswith('x') }}"),
            "True True True False");
  EXPECT_EQ(render("{{ 'aB'.upper() }} {{ 'aB'.lower() }} {{ 'ab cd'.title() }} {{ "
                   "'aaa'.replace('a', 'b', 2) }} {{ 'abcb'.find('b') }} {{ 'abcb'.rfind('b') }}"),
            "AB ab Ab Cd bba 1 3");
  EXPECT_EQ(render("{{ d.get('a') }} {{ d.get('z') }} {{ d.get('z', 0) }} {{ d.keys()|list }} {{ "
                   "d.values()|list }}",
                   {{"d", {{"a", 1}}}}),
            "1 None 0 ['a'] [1]");
}

TEST(Jinja, Globals) {
  EXPECT_EQ(render("{{ range(3)|list }} {{ range(1, 4)|list }} {{ range(6, 0, -2)|list }}"),
            "[0, 1, 2] [1, 2, 3] [6, 4, 2]");
  EXPECT_EQ(render("{{ dict(a=1)['a'] }} {{ namespace(a=2).a }}"), "1 2");
  EXPECT_EQ(error_of("{{ raise_exception('bad ' ~ 1) }}"), "t: bad 1");
  const Functions fns = {
      {"twice", [](const std::vector<json>& a) { return json(a.at(0).get<int>() * 2); }}};
  EXPECT_EQ(Template::parse("{{ twice(21) }}", "t").render(json::object(), fns), "42");
}

TEST(Jinja, GenerationBlockRendersItsBody) {
  EXPECT_EQ(render("a{% generation %}b{{ 1 }}{% endgeneration %}c"), "ab1c");
}

TEST(JinjaRefusals, UnsupportedConstructsAreNamedWithTheirLine) {
  EXPECT_EQ(error_of("{{ x|wordcount }}"), "t line 1: filter 'wordcount' is not supported");
  EXPECT_EQ(error_of("a\nb\n{{ x|center(9) }}"), "t line 3: filter 'center' is not supported");
  EXPECT_EQ(error_of("\n{% if x is escaped %}{% endif %}"),
            "t line 2: test 'escaped' is not supported");
  for (const char* tag : {"include", "extends", "import", "from", "block", "call", "filter", "with",
                          "do", "autoescape"}) {
    EXPECT_EQ(error_of(std::string("{% ") + tag + " x %}"),
              std::string("t line 1: tag '") + tag + "' is not supported");
  }
  EXPECT_EQ(error_of("{% for x in y recursive %}{% endfor %}"),
            "t line 1: recursive for loops are not supported");
  EXPECT_EQ(error_of("{{ f(*args) }}"), "t line 1: '*' and '**' arguments are not supported");
  EXPECT_EQ(error_of("{% break %}"), "t line 1: 'break' outside a for loop");
  EXPECT_EQ(error_of("{% endif %}"), "t line 1: unexpected tag 'endif'");
  EXPECT_EQ(error_of("{{ '{}'.format(1) }}"), "t line 1: str method 'format' is not supported");
  EXPECT_EQ(error_of("{{ [].append(1) }}"), "t line 1: list method 'append' is not supported");
  EXPECT_EQ(error_of("{{ '%s' % 1 }}"), "t line 1: string formatting with '%' is not supported");
  EXPECT_EQ(error_of("{{ 'x'|trim(1, 2) }}"),
            "t line 1: filter 'trim' takes at most 1 arguments (2 given)");
  EXPECT_EQ(error_of("{{ 'x'|tojson(bogus=1) }}"),
            "t line 1: filter 'tojson' got an unexpected keyword argument 'bogus'");
}

TEST(JinjaHostile, SyntaxErrorsAreInputErrors) {
  EXPECT_EQ(error_of("abc {{ x"), "t line 1: unterminated '{{' expression (missing '}}')");
  EXPECT_EQ(error_of("\n{% if x"), "t line 2: unterminated '{%' tag (missing '%}')");
  EXPECT_EQ(error_of("{# never closed"), "t line 1: unterminated comment '{#'");
  EXPECT_EQ(error_of("{{ 'abc }}"), "t line 1: unterminated string literal");
  EXPECT_EQ(error_of("{% if x %}\n\nyes"),
            "t line 3: unexpected end of template, expected 'endif'");
  EXPECT_EQ(error_of("{% for x in y %}"),
            "t line 1: unexpected end of template, expected 'endfor'");
  EXPECT_EQ(error_of("{% raw %}x"), "t line 1: unterminated '{% raw %}' (missing '{% endraw %}')");
  EXPECT_EQ(error_of("{{ 1 + }}"), "t line 1: unexpected end of expression '}}'");
  EXPECT_EQ(error_of("{{ ) }}"), "t line 1: unexpected ')'");
  EXPECT_EQ(error_of("{{ a ? b }}"), "t line 1: unexpected character '?'");
  EXPECT_EQ(error_of("{{ 99999999999999999999 }}"),
            "t line 1: integer literal 99999999999999999999 is too large");
  EXPECT_EQ(error_of("{{ '\\N{DASH}' }}"), "t line 1: '\\N{...}' escapes are not supported");
  for (const char* t :
       {"{%", "{{", "{#", "{% %}", "{{ }}", "{% if %}", "{% for %}", "{% set %}", "{% set x %}",
        "{% macro %}", "{{ [1, 2 }}", "{{ {'a' 1} }}", "{{ x[] }}", "{{ x. }}", "{{ 'a' is }}"}) {
    EXPECT_NE(error_of(t), "") << t;
  }
}

TEST(JinjaHostile, DeepNestingIsRefused) {
  EXPECT_NE(error_of("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}")
                .find("nesting deeper than 256"),
            std::string::npos);
  EXPECT_NE(error_of("{{ " + std::string(5000, '[') + std::string(5000, ']') + " }}")
                .find("nesting deeper than 256"),
            std::string::npos);
  EXPECT_NE(error_of("{{ " + std::string(5000, '-') + "1 }}").find("nesting deeper than 256"),
            std::string::npos);
  std::string ifs;
  for (int i = 0; i < 1000; ++i) ifs += "{% if true %}";
  EXPECT_NE(error_of(ifs).find("nesting deeper than 256"), std::string::npos);
  EXPECT_NE(error_of("{% set ns = namespace(x=[]) %}{% for i in range(2000) %}{% set ns.x = [ns.x] "
                     "%}{% endfor %}")
                .find("value nested deeper than 512"),
            std::string::npos);
  EXPECT_NE(error_of("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}")
                .find("macro calls nested deeper than 64"),
            std::string::npos);
  EXPECT_NE(error_of("{% set ns = namespace() %}{% set ns.me = ns %}")
                .find("namespace inside a namespace"),
            std::string::npos);
}

TEST(JinjaHostile, HugeWorkIsBounded) {
  EXPECT_NE(
      error_of("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
          .find("more than 1000000 loop iterations"),
      std::string::npos);
  EXPECT_NE(error_of("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}")
                .find("output longer than"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 'x' * 100000000 }}").find("string longer than"), std::string::npos);
  EXPECT_NE(error_of("{{ [1] * 100000000 }}").find("list longer than"), std::string::npos);
  EXPECT_NE(error_of("{{ range(1000000000)|list }}").find("larger than the allowed"),
            std::string::npos);
  EXPECT_NE(error_of("{{ 9223372036854775807 + 1 }}").find("integer overflow"), std::string::npos);
  EXPECT_NE(error_of("{{ 1 // 0 }}").find("division or modulo by zero"), std::string::npos);
  EXPECT_NE(error_of("{{ x }}",
                     json::parse(std::string(600, '[') + std::string(600, ']')).is_array()
                         ? json{{"x", json::parse(std::string(600, '[') + std::string(600, ']'))}}
                         : json::object())
                .find("nested deeper"),
            std::string::npos);
  EXPECT_EQ(error_of("{{ x }}", json::array()), "t: the template context must be a JSON object");
}

// Token soup: whatever a template says, the answer is output or InputError, never a crash,
// a hang or another exception type.
TEST(JinjaHostile, RandomTemplatesEndInOutputOrInputError) {
  const std::vector<std::string> pieces = {
      "{{",    "}}",    "{%",         "%}",     "{#",       "#}",   "-",      "+",
      "if",    "elif",  "else",       "endif",  "for",      "in",   "endfor", "set",
      "=",     "ns",    "namespace(", ")",      "(",        "[",    "]",      "{",
      "}",     ",",     ":",          ".",      "|",        "trim", "tojson", "length",
      "is",    "not",   "defined",    "none",   "x",        "m",    "'s'",    "\"q\"",
      "'",     "1",     "-1",         "2.5",    "0",        "and",  "or",     "~",
      "*",     "/",     "//",         "%",      "**",       "==",   "<",      "loop",
      "index", "break", "continue",   "macro",  "endmacro", "raw",  "endraw", "range(",
      "99",    "join",  "split(",     "strip(", "items()",  " ",    "\n",     "  ",
      "\\",    "\xc3",  "\x80",       "\xff"};
  std::mt19937 rng(42);
  const json ctx = {{"x", {1, 2}}, {"m", {{"role", "user"}, {"content", "hi"}}}};
  int outputs = 0, errors = 0;
  for (int n = 0; n < 20000; ++n) {
    std::string t;
    const int len = 1 + static_cast<int>(rng() % 24);
    for (int k = 0; k < len; ++k) t += pieces[rng() % pieces.size()];
    try {
      Template::parse(t, "t").render(ctx);
      ++outputs;
    } catch (const InputError&) {
      ++errors;
    } catch (const std::exception& e) {
      ADD_FAILURE() << json(t).dump() << ": " << e.what();
    }
  }
  EXPECT_GT(outputs, 100);
  EXPECT_GT(errors, 100);
}

TEST(Jinja, RenderIsThreadSafeAndTemplatesCopy) {
  const Template t = Template::parse("{% for i in range(n) %}{{ i }}{% endfor %}", "t");
  const Template copy = t;
  std::vector<std::thread> threads;
  std::vector<std::string> out(8);
  for (int k = 0; k < 8; ++k) {
    threads.emplace_back([&, k] { out[static_cast<std::size_t>(k)] = copy.render({{"n", 5}}); });
  }
  for (auto& th : threads) th.join();
  for (const auto& o : out) EXPECT_EQ(o, "01234");
  EXPECT_EQ(copy.name(), "t");
}

}  // namespace
}  // namespace strata::jinja
