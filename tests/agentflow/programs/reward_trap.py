"""One chat turn, then a reward file that is no file: a FIFO, a link to /dev/zero, or a sparse
file of gigabytes (argv[2]), as a model with a shell tool could leave in the working directory."""

import os
import sys

import openai

client = openai.OpenAI(max_retries=0, timeout=120)
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
path, trap = f"{sys.argv[1]}/reward", sys.argv[2]
if trap == "fifo":
    os.mkfifo(path)  # a read would wait for a writer for ever
elif trap == "zero":
    os.symlink("/dev/zero", path)  # a read to the end never ends
else:
    with open(path, "wb") as f:
        f.write(b"1.0 ")
        f.truncate(64 << 30)  # 64 GiB of zeros after the number (more than the memory), none on disk
