"""One chat turn, then the reward written where the command agent reads it."""

import sys

import openai

client = openai.OpenAI(max_retries=0, timeout=120)
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
with open(f"{sys.argv[1]}/reward", "w") as f:
    f.write("0.75\n")
