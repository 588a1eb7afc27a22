"""Structured outputs: decoding constrained to a JSON schema, any JSON object, a regex, a
choice of strings or an EBNF grammar, with xgrammar.

params.py is plain data that travels with SamplingParams; grammar.py checks a request's
constraint in the front; compiler.py and matchers.py are the runner's side (a compiled
grammar per content, a matcher per sequence, the token bitmask of each step). xgrammar is
imported only where a constraint is used.
"""
