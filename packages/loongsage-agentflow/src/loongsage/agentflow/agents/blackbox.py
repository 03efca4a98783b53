"""The ``command`` agent: any program that speaks OpenAI or Anthropic, run as a black box.

For each of a record's ``n`` samples (an *episode*) the agent opens a gateway session, writes the
prompt into a fresh working directory and starts the command with the session's endpoints in its
environment::

    OPENAI_BASE_URL  OPENAI_API_KEY  ANTHROPIC_BASE_URL  ANTHROPIC_API_KEY
    LOONGSAGE_PROMPT  LOONGSAGE_PROMPT_FILE  LOONGSAGE_WORKDIR

It runs under a supervisor that enforces the timeout and leaves nothing running
(:mod:`loongsage.agentflow.programs.program`), by default in a loopback-only network jail
(:mod:`loongsage.agentflow.programs.jail`). When the program is done the session is closed and exported:
its trajectories carry the program's exit code, timeout, duration and stderr tail in
``metadata["program"]``. An episode whose program completed no chat turn is one trajectory marked
failed, with the reason in ``metadata["failure"]``. The reward comes later from the source's
reward plugin; with ``reward_file`` the float the program wrote to ``{workdir}/reward`` is in
``metadata["reward_file"]`` for the ``file_reward`` reward.

Episodes do not see each other. Every working directory this process makes is in one folder of
its own (under ``workdir_root``, or the temp dir), every relay's control directory in another, and
a sandbox's directory is in its pool's folder; a jailed program sees each of these folders empty
but for its own directory. Otherwise one episode's program could write another's ``reward`` file,
or its solution, while both run.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from loongsage.agentflow.agents.chat_agent import gateway_of
from loongsage.agentflow.programs import netaudit
from loongsage.agentflow.programs.jail import bwrap_problem
from loongsage.agentflow.programs.program import MARKER, Launch, Outcome, run_program
from loongsage.core.concurrency import gather_all
from loongsage.core.schema import ranged
from loongsage.core.types import DataRecord, RewardInfraError, Status, Trajectory

log = logging.getLogger("loongsage.agentflow")
_EPISODE_ROOTS: dict[tuple[int, str | None], str] = {}


def _episodes_root(base: str | None) -> str:
    """This process's folder for episode directories under ``base`` (the temp dir when None), made
    on first use: a jail hides it whole and binds back its program's own directory."""
    key = (os.getpid(), base)  # a forked worker makes its own
    root = _EPISODE_ROOTS.get(key)
    if root is None or not os.path.isdir(root):
        if not _EPISODE_ROOTS:
            atexit.register(_remove_empty_roots)
        root = _EPISODE_ROOTS[key] = tempfile.mkdtemp(prefix="lsg-episodes-", dir=base)
    return root


def _remove_empty_roots() -> None:
    """At exit: the episode folders this process made, where nothing was kept in them (keep_workdir)."""
    for (pid, _), root in _EPISODE_ROOTS.items():
        if pid == os.getpid():
            with contextlib.suppress(OSError):
                os.rmdir(root)


# what the program inherits from the driver without inherit_env: enough to find and run programs,
# not the driver's credentials or proxies
_PASSED = ("PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TERM", "TMPDIR", "TZ")
_LOOPBACK = "127.0.0.1,localhost,::1"
_ENV_PROMPT_MAX = 100_000  # one environment string is limited to 128 KiB by the kernel
_TAIL_CHARS = 2000
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")
SANDBOXES = "sandboxes"  # the loongsage-sandbox run service that sandbox=True takes its sandboxes from


@dataclass
class CommandAgent:
    """Runs ``command`` once per sample against its own gateway session (agent ``command``)."""

    # argv; {prompt_file}, {workdir} and {python} (the driver's interpreter) are replaced in every
    # item (and in env values)
    command: list[str]
    timeout_s: float = ranged(600.0, gt=0, note="wall clock of one episode's program")
    grace_s: float = ranged(5.0, ge=0, note="between SIGTERM and SIGKILL")
    max_concurrency: int = ranged(8, ge=1, note="programs of this agent running at once")
    env: dict[str, str] = field(default_factory=dict)  # added to the program's environment
    inherit_env: bool = False  # pass the driver's whole environment (default: PATH, HOME, locale only)
    # loopback_only: a network namespace holding only loopback, the gateway relayed in (bubblewrap);
    # host: no jail; auto: loopback_only where bubblewrap can make namespaces, else host with a warning
    network: Literal["auto", "loopback_only", "host"] = "auto"
    max_output_bytes: int = ranged(1 << 20, ge=0, note="kept per stream: the last bytes")
    log_dir: str | None = None  # where each episode's kept stdout/stderr are written (null: metadata tails only)
    workdir_root: str | None = None  # where the folder of the episodes' working directories is made (null: temp dir)
    keep_workdir: bool = False
    reward_file: bool = False  # read the float the program wrote to {workdir}/reward
    # program: each request samples with its own temperature, top-p, top-k and min-p; source: with
    # the source's, whatever the program asks (its trajectories are then the source's policy's
    # samples, as a run's other agents give). Each turn's record (metadata "turns") holds what it used
    sampling_from: Literal["program", "source"] = "program"
    # paths the program does not see, inside the loopback-only jail (a folder is empty there, a file
    # empty): the run's data files, which hold the labels, and any answers a model with a shell
    # tool could otherwise read. Needs network: loopback_only
    hide: list[str] = field(default_factory=list)
    # run the program under strace and report every destination it tried to reach (programs/netaudit.py)
    audit_network: bool = False
    # each episode's working directory is a sandbox of the run's `sandboxes` service (loongsage-sandbox),
    # on this machine: what the program leaves there stays in the sandbox for the reward (code_tests
    # with solution_file runs the task's tests in it), until the rollout is done with the trajectory
    sandbox: bool = False
    required_services: ClassVar[tuple[str, ...]] = ("gateway",)  # checked at validation

    def __post_init__(self) -> None:
        if (
            not isinstance(self.command, list)
            or not self.command
            or not all(isinstance(a, str) and a for a in self.command)
        ):
            raise ValueError(f"command={self.command!r}: must be a non-empty list of non-empty strings (an argv)")
        for key, value in (self.env or {}).items():
            if not isinstance(value, str) or not key or "=" in key:
                raise ValueError(f"env={{{key!r}: {value!r}}}: names without '=' and string values")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s={self.timeout_s!r}: must be > 0")
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s={self.grace_s!r}: must be >= 0")
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 1:
            raise ValueError(f"max_concurrency={self.max_concurrency!r}: must be an int >= 1")
        if self.audit_network and netaudit.strace_problem():
            raise ValueError(f"audit_network=True: {netaudit.strace_problem()}")
        self.jailed = self._resolve_network()
        self.hidden = self._hidden_paths()
        if self.sandbox:
            if self.workdir_root is not None or self.keep_workdir:
                raise ValueError(
                    "sandbox=True: the working directory is the sandbox's; drop workdir_root and keep_workdir"
                )
            self.required_services = ("gateway", SANDBOXES)
        self._limit: tuple[Any, asyncio.Semaphore] | None = None  # (event loop, its semaphore)

    def _hidden_paths(self) -> tuple[str, ...]:
        if not self.hide:
            return ()
        if not self.jailed:
            raise ValueError(
                f"hide={self.hide!r}: paths are hidden inside the loopback-only jail; set network: loopback_only"
            )
        hidden = []
        for path in self.hide:
            if not isinstance(path, str) or not path:
                raise ValueError(f"hide: {path!r} is not a path")
            resolved = os.path.realpath(path)
            if not os.path.exists(resolved):
                raise ValueError(f"hide: {path!r} does not exist")
            if resolved == "/":
                raise ValueError("hide: '/' would hide everything, the program itself included")
            hidden.append(resolved)
        return tuple(hidden)

    def _hidden_with(self, private: tuple[str, ...]) -> tuple[str, ...]:
        """``hide`` and the run's private paths that exist (a folder the run has yet to write is none)."""
        return (*self.hidden, *(p for p in private if p not in self.hidden and os.path.exists(p)))

    def _resolve_network(self) -> bool:
        problem = bwrap_problem() if self.network != "host" else None
        if self.network == "loopback_only" and problem:
            raise ValueError(f"network='loopback_only': {problem}")
        if self.network == "host" or problem:
            why = f" ({problem})" if problem else ""
            log.warning("command agent: network=host%s; the program %r may reach the network", why, self.command[0])
            return False
        return True

    # ------------------------------------------------------------------------------ episodes
    async def run(self, record: DataRecord, ctx: Any) -> list[Trajectory]:
        gateway = gateway_of(ctx, "gateway", "command")
        sandboxes = ctx.services.get(SANDBOXES) if self.sandbox else None
        if self.sandbox and sandboxes is None:
            raise RuntimeError(
                f"command agent: sandbox=True needs the run service {SANDBOXES!r}; add services: "
                f"[{{name: {SANDBOXES}}}] (running: {sorted(ctx.services) or 'none'})"
            )
        loop = asyncio.get_running_loop()
        if self._limit is None or self._limit[0] is not loop:
            self._limit = (loop, asyncio.Semaphore(self.max_concurrency))
        limit = self._limit[1]
        episodes = await gather_all(
            *(self._limited(limit, record, ctx, gateway, k, sandboxes) for k in range(ctx.sampling.n))
        )
        group = [t for episode in episodes for t in episode]
        for index, t in enumerate(group):
            t.sample_index = index  # a session may export several lines (n > 1, side conversations)
        return group

    async def _limited(
        self, limit: asyncio.Semaphore, record: DataRecord, ctx: Any, gateway: Any, k: int, sandboxes: Any
    ) -> list[Trajectory]:
        private = ctx.private_paths  # the run's data files and folder, hidden in the jail
        async with limit:
            if sandboxes is None:
                return await self.episode(record, ctx.group_id, k, gateway, sampling=ctx.sampling, private=private)
            return await self._in_sandbox(sandboxes, record, ctx.group_id, k, gateway, ctx.sampling, private)

    async def _in_sandbox(
        self,
        sandboxes: Any,
        record: DataRecord,
        group_id: int,
        k: int,
        gateway: Any,
        sampling: Any,
        private: tuple[str, ...] = (),
    ) -> list[Trajectory]:
        """An episode whose working directory is a leased sandbox's: the lease goes with its
        trajectories (ended once they are scored), or ends here when the episode fails or is cancelled."""
        box = await sandboxes.acquire(_episode_key(record, group_id, k))
        try:
            if box.host_path is None:
                raise ValueError(
                    f"command agent: sandbox=True needs a sandbox backend with a directory on this "
                    f"machine (host_path), like 'local'; sandbox {box.sandbox_id!r} has none"
                )
            trajectories = await self.episode(
                record, group_id, k, gateway, workdir=Path(box.host_path), sampling=sampling, private=private
            )
            await box.adopt()  # what the program wrote becomes the sandbox's (its uid may change it)
        except BaseException:
            # the lease is back before the episode ends, even when a second cancellation (its
            # group's, say) arrives while the release is under way
            release = asyncio.ensure_future(box.release())
            while not release.done():
                try:
                    await asyncio.shield(release)
                except asyncio.CancelledError:
                    continue
            raise
        for t in trajectories:
            box.attach(t)
        return trajectories

    async def episode(
        self,
        record: DataRecord,
        group_id: int,
        k: int,
        gateway: Any,
        workdir: Path | None = None,
        sampling: Any = None,
        private: tuple[str, ...] = (),
    ) -> list[Trajectory]:
        """One program run against one session; its exported trajectories (or one failed).
        ``workdir``: the program's working directory (default: a fresh one, removed afterwards);
        ``sampling``: the source's sampling, told to the program in ``LOONGSAGE_SAMPLING``;
        ``private``: the run's files the jailed program sees empty, beside ``hide``."""
        started = time.monotonic()
        name = f"{_episode_key(record, group_id, k)}-{secrets.token_hex(4)}"
        own_workdir = workdir is None
        if workdir is None:
            workdir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=_episodes_root(self.workdir_root)))
        # the folders holding other episodes' directories: empty to this one's program but for its
        # own (a sandbox's pool folder too, unless a backend keeps its sandboxes in a shared one)
        controls = _episodes_root(None)
        shared = {"/", tempfile.gettempdir(), os.path.expanduser("~")}
        siblings = tuple(p for p in (str(workdir.parent), controls) if os.path.realpath(p) not in shared)
        try:
            control = tempfile.mkdtemp(prefix="lsg-", dir=controls)  # short: it holds the relay's Unix socket
            info = gateway.open_session(name, sampling=sampling if self.sampling_from == "source" else None)
            try:
                prompt_file = _write_prompt(workdir, record.prompt)
                env = self._env(info, gateway, record.prompt, prompt_file, workdir, name)
                if sampling is not None:  # a program may follow the run's sampling (greedy in evaluation)
                    env["LOONGSAGE_SAMPLING"] = json.dumps(
                        {
                            "temperature": 0.0 if sampling.greedy else sampling.temperature,
                            "top_p": sampling.top_p,
                            "top_k": sampling.top_k,
                            "max_tokens": sampling.max_new_tokens,
                        }
                    )
                argv = [_fill(a, prompt_file, workdir) for a in self.command]
                argv = self.prepare(workdir, record.prompt, argv, env)
                trace = os.path.join(control, "connections.strace") if self.audit_network else None
                launch = Launch(
                    argv=netaudit.traced(argv, trace) if trace else argv,
                    env=env,
                    cwd=str(workdir),
                    control_dir=control,
                    timeout_s=self.timeout_s,
                    grace_s=self.grace_s,
                    max_output_bytes=self.max_output_bytes,
                    jail=self.jailed,
                    gateway=_target(gateway),
                    hidden=(*self._hidden_with(private), *dict.fromkeys(siblings)) if self.jailed else (),
                )
                outcome = await run_program(launch)
                facts = self.report(workdir)
                if trace:
                    facts["network_audit"] = netaudit.report(trace)
            finally:
                session = await gateway.close_session(name, 0)
                shutil.rmtree(control, ignore_errors=True)
            meta = self._metadata(record, name, workdir, outcome, started, facts)  # reads {workdir}/reward
        finally:
            if own_workdir and not self.keep_workdir:
                shutil.rmtree(workdir, ignore_errors=True)
        trajectories = session.trajectories(source=record.source, group_id=group_id)
        for t in trajectories:
            t.metadata.update(meta)
        if trajectories:
            return trajectories
        why = outcome.error or "the program made no chat request that completed a turn"
        return [
            _failed(
                record,
                group_id,
                meta,
                f"{why} (exit code {outcome.exit_code}, signal {outcome.signal}, "
                f"timed out {outcome.timed_out}, {session.refusals} refused)",
            )
        ]

    # ------------------------------------------------------------------ hooks of specialised agents
    def prepare(self, workdir: Path, prompt: Any, argv: list[str], env: dict[str, str]) -> list[str]:
        """Before the program starts: write what it needs into ``workdir`` (its configuration), edit
        ``env`` (it holds the session's URL and key); returns the argv to run."""
        return argv

    def report(self, workdir: Path) -> dict[str, Any]:
        """After the program ended, before ``workdir`` is removed: facts for ``metadata["program"]``."""
        return {}

    def _env(
        self, info: Any, gateway: Any, prompt: Any, prompt_file: str, workdir: Path, marker: str
    ) -> dict[str, str]:
        base = dict(os.environ) if self.inherit_env else {k: os.environ[k] for k in _PASSED if k in os.environ}
        env = {**base, **{k: _fill(v, prompt_file, workdir) for k, v in self.env.items()}}
        url = info.base_url
        if self.jailed:  # the relay listens on the namespace's own 127.0.0.1 at the gateway's port
            url = f"http://127.0.0.1:{gateway.port}/{info.trajectory}/{info.attempt}"
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
        no_proxy = ",".join(v for v in (env.get("NO_PROXY"), _LOOPBACK) if v)
        env.update(
            {
                "OPENAI_BASE_URL": f"{url}/v1",
                "OPENAI_API_KEY": info.api_key or "none",
                "ANTHROPIC_BASE_URL": url,
                "ANTHROPIC_API_KEY": info.api_key or "none",
                "LOONGSAGE_PROMPT_FILE": prompt_file,
                "LOONGSAGE_WORKDIR": str(workdir),
                "NO_PROXY": no_proxy,
                "no_proxy": no_proxy,
                MARKER: marker,
            }
        )
        if len(text) <= _ENV_PROMPT_MAX and "\0" not in text:
            env["LOONGSAGE_PROMPT"] = text
        return env

    def _metadata(
        self, record: DataRecord, name: str, workdir: Path, outcome: Outcome, started: float, facts: dict[str, Any]
    ) -> dict[str, Any]:
        program = {
            "exit_code": outcome.exit_code,
            "signal": outcome.signal,
            "timed_out": outcome.timed_out,
            "wall_s": round(outcome.wall_s, 3),
            "episode_s": round(time.monotonic() - started, 3),
            "stderr_tail": outcome.stderr.tail(_TAIL_CHARS),
            "stdout_tail": outcome.stdout.tail(_TAIL_CHARS),
            "stdout_bytes": outcome.stdout.total,
            "stderr_bytes": outcome.stderr.total,
            "leftover_processes": outcome.leftover + outcome.swept,
            "network": "loopback_only" if self.jailed else "host",
            "error": outcome.error,
            "workdir": str(workdir) if self.keep_workdir else None,
            **facts,
        }
        if self.log_dir is not None:
            logs = Path(self.log_dir)
            logs.mkdir(parents=True, exist_ok=True)
            for stream, capture in (("stdout", outcome.stdout), ("stderr", outcome.stderr)):
                (logs / f"{name}.{stream}").write_bytes(bytes(capture.kept))
            program["logs"] = str(logs / name)
            summary = {k: v for k, v in program.items() if not k.endswith("_tail")}  # the tails are in the files
            (logs / f"{name}.json").write_text(json.dumps(summary, indent=1, default=str))
        meta: dict[str, Any] = {"record_index": record.index, "program": program}
        if self.reward_file:
            meta["reward_file"], meta["reward_file_error"] = _read_reward(workdir / "reward")
        return meta


def _episode_key(record: DataRecord, group_id: int, k: int) -> str:
    """``cmd-<source>-g<group>-s<sample>``, safe as a file and session name (at most 110 characters)."""
    return _UNSAFE.sub("_", f"cmd-{record.source}-g{group_id}-s{k}")[:110]


def _fill(text: str, prompt_file: str, workdir: Path) -> str:
    return (
        text.replace("{prompt_file}", prompt_file)
        .replace("{workdir}", str(workdir))
        .replace("{python}", sys.executable)
    )


def _write_prompt(workdir: Path, prompt: Any) -> str:
    if isinstance(prompt, str):
        path = workdir / "prompt.txt"
        path.write_text(prompt, encoding="utf-8")
    else:  # chat messages
        path = workdir / "prompt.json"
        path.write_text(json.dumps(prompt, ensure_ascii=False), encoding="utf-8")
    return str(path)


def _target(gateway: Any) -> tuple[str, int]:
    host = gateway.host if gateway.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
    return host, gateway.port


_REWARD_BYTES = 100  # a number's text; more is not read


def _read_reward(path: Path) -> tuple[float | None, str | None]:
    """The reward file's number, or why there is none. The file is in reach of the model's own
    tools, so only a regular file is read, and only its first bytes: not through a link (to
    ``/dev/zero``), not a FIFO (whose read waits for ever), not a sparse file of gigabytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None, "the program wrote no reward file"
    except OSError as exc:
        return None, f"reward file unreadable (a regular file, not a link, is read): {exc}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None, "reward file is not a regular file"
        text = os.read(fd, _REWARD_BYTES).decode("utf-8", "replace").strip()
    except OSError as exc:
        return None, f"reward file unreadable: {exc}"
    finally:
        os.close(fd)
    try:
        value = float(text)
    except ValueError:
        return None, f"reward file holds {text!r}, not a number"
    if value != value or value in (float("inf"), float("-inf")):
        return None, f"reward file holds {text!r}, not a finite number"
    return value, None


def _failed(record: DataRecord, group_id: int, meta: dict[str, Any], reason: str) -> Trajectory:
    return Trajectory(
        source=record.source,
        group_id=group_id,
        sample_index=0,
        prompt_ids=[],
        response_ids=[],
        loss_mask=[],
        rollout_logprobs=[],
        versions=[],
        status=Status.FAILED,
        metadata={**meta, "failure": reason},
    )


# ------------------------------------------------------------------------------------ reward
@dataclass(frozen=True)
class FileReward:
    """``file_reward``: the float the command agent's program wrote to ``{workdir}/reward``.

    Needs the agent's ``reward_file: true``. The program (a wrapper that runs the agent, then the
    tests, say) should write the file last: the model's own tools may write the working directory too.
    """

    default: float | None = None  # the reward when no valid file was written; null: the trajectory fails

    def __call__(self, trajectory: Trajectory, record: DataRecord) -> float:
        value = trajectory.metadata.get("reward_file")
        if value is not None:
            return float(value)
        if self.default is not None:
            return self.default
        why = (
            trajectory.metadata.get("reward_file_error")
            or "no reward_file in the metadata (set the command agent's reward_file: true)"
        )
        raise RewardInfraError(f"file_reward: {why}")
