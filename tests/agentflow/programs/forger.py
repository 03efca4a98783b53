"""One turn, then an attempt on other episodes' files: what it sees beside its own working
directory and control directory, and a write of 1.0 into every ``reward`` file it can reach there
(argv: its workdir, a sibling episode's workdir, a sibling control dir)."""

import json
import os
import sys

import openai

client = openai.OpenAI(max_retries=0, timeout=120)
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
workdir, victim, victim_control = sys.argv[1:4]
result = {"beside_workdir": sorted(os.listdir(os.path.dirname(workdir)))}
for name, folder in (("victim", victim), ("victim_control", victim_control)):
    try:
        with open(os.path.join(folder, "reward"), "w") as f:
            f.write("1.0")
        result[name] = "written"
    except OSError as exc:
        result[name] = type(exc).__name__
print(json.dumps(result))
