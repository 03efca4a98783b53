"""Inside the jail: reach the gateway, then try addresses that must be unreachable.

It connects nowhere unless the namespace has no interface but loopback, so a broken jail cannot
make it send anything off the machine.
"""

import errno
import json
import os
import socket
import time

import openai

client = openai.OpenAI(max_retries=0, timeout=120)
reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
with open("/proc/net/dev") as f:
    interfaces = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
result = {"reply": reply.choices[0].message.content is not None, "interfaces": interfaces, "connect": {}}
if interfaces == ["lo"]:
    targets = ["10.255.255.1"] + [ip for ip in [os.environ.get("HOST_IP")] if ip]
    for ip in targets:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(5)
        start = time.monotonic()
        try:
            sock.connect((ip, 80))
            outcome = "connected"
        except OSError as exc:
            outcome = errno.errorcode.get(exc.errno, str(exc)) if exc.errno else type(exc).__name__
        result["connect"][ip] = [outcome, round(time.monotonic() - start, 3)]
        sock.close()
print(json.dumps(result))
