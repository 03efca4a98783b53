"""Opens 100 connections to the gateway and holds them idle, counts those closed on it, lets them
go, then has one turn: a program trying to take every connection the runner can hold."""

import json
import os
import socket
import time
import urllib.parse

import openai

url = urllib.parse.urlparse(os.environ["OPENAI_BASE_URL"])
held = [socket.create_connection((url.hostname, url.port)) for _ in range(100)]
time.sleep(1.5)
closed = 0
for sock in held:
    sock.setblocking(False)
    try:
        closed += sock.recv(1) == b""
    except BlockingIOError:
        pass  # open, idle
    except ConnectionResetError:
        closed += 1
for sock in held:
    sock.close()
time.sleep(0.5)
client = openai.OpenAI(max_retries=0, timeout=120)
client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
print(json.dumps({"closed": closed}))
