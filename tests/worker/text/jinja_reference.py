#!/usr/bin/env python3
"""Renders chat templates with jinja2 exactly as transformers does, for Strata's tests.

transformers (utils/chat_template_utils.py, _compile_jinja_template) uses
ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
extensions=[AssistantTracker, loopcontrols]), overrides `tojson` with json.dumps(ensure_ascii=False, ...)
and adds the globals raise_exception and strftime_now. apply_chat_template renders with
messages, tools (None unless given), documents (None), add_generation_prompt, and the
tokenizer's special tokens merged with the caller's extra kwargs.

stdin: {"template": str,
        "special_tokens": {...},               # optional, chat mode
        "cases": [{"messages": [...], "add_generation_prompt": bool, "extra": {...}}]
        or "contexts": [{...}, ...]}           # plain mode: render(**context)
    or {"renders": [{"template": str, "context": {...}}, ...]}  # many templates
stdout: a JSON list with {"ok": rendered} or {"error": message} per case.
"""
import json
import sys
from datetime import datetime

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


class Generation(Extension):
    """transformers' {% generation %} block (it records assistant spans for a token mask;
    the rendered text is the body, unchanged)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def compile_template(source):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render(compile_source, context):
    try:
        return {"ok": compile_source().render(**context)}
    except Exception as e:  # the test compares messages, not Python exception types
        return {"error": str(e)}


def main():
    request = json.load(sys.stdin)
    if "renders" in request:
        results = [render(lambda r=r: compile_template(r["template"]), r.get("context", {}))
                   for r in request["renders"]]
        sys.stdout.write(json.dumps(results))
        return
    template = None

    def compiled():
        nonlocal template
        if template is None:
            template = compile_template(request["template"])
        return template

    results = []
    if "contexts" in request:
        for context in request["contexts"]:
            results.append(render(compiled, context))
    else:
        special = request.get("special_tokens", {})
        for case in request["cases"]:
            extra = dict(case.get("extra", {}))
            tools = extra.pop("tools", None)
            documents = extra.pop("documents", None)
            context = {"messages": case["messages"], "tools": tools, "documents": documents,
                       "add_generation_prompt": case.get("add_generation_prompt", False),
                       **{**special, **extra}}
            results.append(render(compiled, context))
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
