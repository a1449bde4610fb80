"""The processes of a multi-process run agree on what they run, and share one workdir.

A pod run is one command sent to every host (`gcloud ... --worker=all`, SLURM, a job
template), and its classic mistakes are hosts that do not agree: a flag that differs, a recipe
or a source file edited on one host only, another commit or another jax checked out there, a
corpus that differs, a workdir on each host's local disk. Left alone, processes that compiled
different programs abort in their first collective (gloo's "size doesn't match"), differences
that keep the shapes train one model from two recipes without a word, and local workdirs never
commit a checkpoint (orbax waits for every process to finish a save in the one directory).

So before anything compiles, every process publishes what it is about to run through the
coordination service's key-value store (no device collective, no compiled program) and reads
every other process's:

* `agree(facts)`: {name: value} (the resolved config's settings, the code, the library
  versions, the data), compared across the processes. Where they differ, every process raises
  the same Disagreement (a ValueError) naming the first settings that differ and their value on each process.
* `check_shared_workdir(workdir)`: process 0 writes a token file into the workdir and every
  process reads it back. A process that cannot see it makes every process refuse: a
  multi-process run needs one path that every host sees (a bucket, NFS).

Every process reaches the same verdict from the same published values, so each raises the same
error and main.py's handler stops the run everywhere (distributed.stop_run). A process that
never publishes (dead, or stopped by an error of its own) is the peer watch's: the run stops
with its name within the peer timeout.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import pathlib
import secrets
import socket
import subprocess
from typing import Any

import jax
from etils import epath

# The project's own packages: their sources are the code every process must share.
REPO = pathlib.Path(__file__).resolve().parent.parent
SOURCE_DIRS = ('configs', 'input_pipeline', 'models', 'training')
SOURCE_FILES = ('main.py',)
# The libraries whose versions change the programs or the checkpoints.
LIBRARIES = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'libtpu', 'numpy',
             'tensorflow-datasets', 'sentencepiece')
TOKEN_FILE = '.shared_workdir_token'
# How many differing settings the error names (the first, in sorted order).
NAMED = 3
# How long a process waits for the others to publish: they may start minutes apart on a pod,
# and process 0 prepares a local corpus before the data's round.
TIMEOUT_SECONDS = 600

_rounds = {'n': 0}  # Each call is one round, in the same order on every process.


class Disagreement(ValueError):
  """The processes differ, or do not share the workdir: every process raises it, with the same
  message, from the same published values (so none needs to stop the others)."""


def _client():
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  return jax_distributed.global_state.client


def _who(index: int, identity: dict) -> str:
  return f'process {index} (host {identity.get("host", "?")}, pid {identity.get("pid", "?")})'


def _exchange(name: str, value: Any) -> list[Any]:
  """Publishes `value` (JSON-able) under round `name` and returns every process's, in process
  order, each as {'value', 'host', 'pid'}."""
  _rounds['n'] += 1
  prefix = f'agreement/{_rounds["n"]}_{name}/'
  client = _client()
  index, count = jax.process_index(), jax.process_count()
  mine = {'value': value, 'host': socket.gethostname(), 'pid': os.getpid()}
  client.key_value_set(prefix + str(index), json.dumps(mine, sort_keys=True, default=str))
  out = []
  for i in range(count):
    if i == index:
      out.append(json.loads(json.dumps(mine, sort_keys=True, default=str)))
      continue
    try:
      raw = client.blocking_key_value_get(prefix + str(i), TIMEOUT_SECONDS * 1000)
    except Exception as e:  # pylint: disable=broad-except  (DEADLINE_EXCEEDED from the service)
      raise ValueError(f'process {i} of {count} did not publish its {name} within '
                       f'{TIMEOUT_SECONDS} s: it is not running this command, or is stuck before '
                       f'it ({type(e).__name__})') from None
    out.append(json.loads(raw))
  return out


def _shown(value: Any) -> str:
  text = json.dumps(value, sort_keys=True, default=str)
  return text if len(text) <= 80 else text[:77] + '...'


def differences(published: list[dict]) -> list[str]:
  """The keys of the published facts whose values are not the same on every process, sorted."""
  keys = sorted(set().union(*(p['value'] for p in published)))
  return [k for k in keys
          if len({json.dumps(p['value'].get(k, '<absent>'), sort_keys=True, default=str)
                  for p in published}) > 1]


def agree(what: str, facts: dict[str, Any], advice: str) -> None:
  """Raises Disagreement on every process unless every process published the same `facts`.

  Args:
    what: what the facts are, for the message ('settings', 'data').
    facts: {name: JSON-able value}.
    advice: what to do about a difference, the message's end.
  """
  if jax.process_count() == 1:
    return
  published = _exchange(what.replace(' ', '_'), facts)
  differ = differences(published)
  if not differ:
    return
  parts = []
  for key in differ[:NAMED]:
    values = ', '.join(
        f'{_shown(p["value"].get(key, "<absent>"))} on {_who(i, p)}'
        for i, p in enumerate(published))
    parts.append(f'{key}: {values}')
  more = f' (and {len(differ) - NAMED} more)' if len(differ) > NAMED else ''
  raise Disagreement(f'the {len(published)} processes of this run do not agree on their {what}: '
                   f'{"; ".join(parts)}{more}. {advice}')


# --- What a process runs. -----------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def code() -> dict[str, str]:
  """{'code.commit': the git commit, or '' without git; 'code.sources': a hash of the package's
  Python sources; 'code.file.<path>': each source's hash} of the code this process runs. The
  sources count, not only the commit: a file edited on one host keeps the commit."""
  files = sorted([REPO / f for f in SOURCE_FILES] +
                 [p for d in SOURCE_DIRS for p in (REPO / d).rglob('*.py')])
  each = {}
  total = hashlib.sha256()
  for path in files:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    rel = path.relative_to(REPO).as_posix()
    each[f'code.file.{rel}'] = digest
    total.update(f'{rel}:{digest}\n'.encode())
  try:
    commit = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO, capture_output=True,
                            text=True, timeout=10, check=False).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    commit = ''
  return {'code.commit': commit, 'code.sources': total.hexdigest()[:16], **each}


def versions() -> dict[str, str]:
  """{'version.<library>': its installed version, or 'absent'}."""
  out = {}
  for name in LIBRARIES:
    try:
      out[f'version.{name}'] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[f'version.{name}'] = 'absent'
  return out


def settings(flat_config: dict[str, Any]) -> dict[str, Any]:
  """The run's facts before its data: {'config.<key>': value} of the resolved config, the code
  and the library versions."""
  return {**{f'config.{k}': v for k, v in flat_config.items()}, **code(), **versions()}


SETTINGS_ADVICE = ('Every process of a run must be started with the same command (flags and '
                   '--config overrides), recipe, code and libraries: fix the hosts that differ '
                   'and start them all again')
DATA_ADVICE = ('Every process must read the same dataset (the same prepared TFDS version, or '
               'the same local_text corpus): fix the hosts that differ and start them all again')


# --- One workdir for all. ---------------------------------------------------------------------

def check_shared_workdir(workdir: str) -> None:
  """Raises Disagreement on every process unless each sees the token process 0 wrote into
  `workdir`: a multi-process run needs one workdir that every host sees."""
  if jax.process_count() == 1:
    return
  path = epath.Path(workdir) / TOKEN_FILE
  token = ''
  if jax.process_index() == 0:
    token = f'{secrets.token_hex(16)} {socket.gethostname()} {os.getpid()}'
    path.write_text(token)
  token = _exchange('workdir_token', token)[0]['value']
  try:
    seen = path.read_text() if path.exists() else None
  except OSError as e:
    seen = f'<unreadable: {e}>'
  verdicts = _exchange('workdir_verdict', {'sees': seen == token, 'workdir': workdir})
  blind = [(i, p) for i, p in enumerate(verdicts) if not p['value']['sees']]
  if jax.process_index() == 0:
    try:
      path.unlink()
    except OSError:
      pass
  if blind:
    where = '; '.join(f'{_who(i, p)} given --workdir={p["value"]["workdir"]}' for i, p in blind)
    raise Disagreement(
        f'the {len(verdicts)} processes of this run do not share one workdir: {where} cannot '
        f'see the file {TOKEN_FILE} that {_who(0, verdicts[0])} wrote into '
        f'--workdir={verdicts[0]["value"]["workdir"]}. A multi-process run needs one workdir '
        'that every host reads and writes (a bucket such as gs://..., or an NFS path mounted '
        'on every host), given as the same --workdir on every host; folders on each host\'s '
        'local disk never commit a checkpoint')
