"""A two-turn conversation with the official OpenAI client, configured by the environment only."""

import os
import sys

import openai

prompt = open(sys.argv[1]).read()
assert prompt == os.environ["LOONGSAGE_PROMPT"], "the prompt file and LOONGSAGE_PROMPT differ"
client = openai.OpenAI(max_retries=0, timeout=120)  # OPENAI_BASE_URL and OPENAI_API_KEY
messages = [{"role": "user", "content": prompt}]
first = client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=0)
messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "and then?"}]
client.chat.completions.create(model="policy", messages=messages, max_tokens=8, temperature=0)
print("chat2 finished in", os.getcwd())
print("chat2 done", file=sys.stderr)
