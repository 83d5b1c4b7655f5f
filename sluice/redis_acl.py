"""Redis ACL users per role: what each service may do on the bus, as ACL rules (pure: no I/O).

Theory of operation
- Every service that uses Redis gets its own Redis user, named after its role, whose rule allows only
  the commands its `sluice.bus.Bus` calls issue and only the keys of its streams (`Bus.key` naming:
  `sluice:{<namespace>:<stream>}[:suffix]`, the dead-letter stream `...:dead`):

  | role | keys | commands |
  |---|---|---|
  | scheduler | `kv:*`, `completions`, `tokens:*` | XADD (publish tokens, completions, KV events), PING |
  | router | `kv:*` (+ dead letters), `completions` (+ dead letters) | consume (XGROUP CREATE, XREADGROUP, XAUTOCLAIM, XACK, XADD to `:dead`), PING |
  | admission | `completions` (+ dead letters), its own `tokens:<owner>` | consume, XADD (REJECTED completions of abandoned attempts), XREAD, PING |
  | admission, shared budgets | also `budgets` | also EVALSHA, SCRIPT LOAD (the one script of admission_svc/shares.py) and what it calls: TIME, HGET, HGETALL, HSET, HDEL |

  Workers and the planner do not use Redis and get no user. No role may use pub/sub (`resetchannels`),
  scripts (but admission's shares script under shared budgets), KEYS/SCAN, DEL, FLUSH*, CONFIG or ACL.
  The `default` user stays the operator's (every key, every command, the admin password); services never use it.
- What the rules cannot express (Redis 6.2, the embedded server, has no read-only/write-only key
  patterns nor per-key command sets): a scheduler may XADD to any KV shard and any owner's token stream
  (it serves every admission process) but cannot read a single entry (no read command at all); the
  router may XADD to the KV and completion streams it consumes (dead letters need XADD there);
  admission may XADD to its own token stream.
- `redis-py` sends nothing on connect but AUTH (always allowed), SELECT for a database other than 0
  (allowed: key patterns hold in every database) and CLIENT SETINFO, whose refusal it ignores. A cluster
  client also needs CLUSTER SLOTS and COMMAND (`cluster=True`).
- Passwords go to the ACL file as SHA-256 hashes (`#<hex>`), so the file does not hold them; services get
  theirs in their Redis URL (`user_url`), by environment.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import quote, urlsplit, urlunsplit

__all__ = ["AclRule", "Role", "acl_file_text", "acl_setuser_commands", "key_of", "rules", "user_url"]


class Role(StrEnum):
    """The services that use Redis; the value is the Redis user name."""

    ADMISSION = "admission"
    ROUTER = "router"
    SCHEDULER = "scheduler"


CONNECT_COMMANDS = ("ping", "select")
"""Every role: the liveness probe (sluice.serve.BusWatch) and SELECT for a URL naming a database."""
CLUSTER_COMMANDS = ("cluster|slots", "command")
"""What a cluster client sends to learn the slots and the commands' key positions."""
CONSUME_COMMANDS = ("xgroup|create", "xreadgroup", "xautoclaim", "xack", "xadd")
"""`Bus.consume`: create the group, read, take over idle entries, acknowledge, dead-letter."""
_GLOB = re.compile(r"([*?\[\]\\])")


@dataclass(frozen=True)
class AclRule:
    """One Redis user's rights."""

    user: str
    """The Redis user name (the role's value)."""
    keys: tuple[str, ...]
    """Key glob patterns the user may touch (without the `~`)."""
    commands: tuple[str, ...]
    """Commands (or `command|subcommand`) the user may run; everything else is refused with NOPERM."""

    def tokens(self) -> list[str]:
        """Return the rule as ACL tokens after the password: reset, keys, no channels, commands."""
        return ["resetkeys", "resetchannels", "-@all", *(f"~{k}" for k in self.keys),
                *(f"+{c}" for c in self.commands)]


def _glob_escape(text: str) -> str:
    return _GLOB.sub(r"\\\1", text)


def key_of(namespace: str, stream: str, *suffix: str) -> str:
    """Return the Redis key of logical stream `stream` (the naming of sluice.bus.Bus.key)."""
    return ":".join((f"sluice:{{{namespace}:{stream}}}", *suffix))


def _stream_and_dead(namespace: str, stream: str) -> tuple[str, str]:
    key = _glob_escape(key_of(namespace, stream))
    return key, f"{key}:dead"


def rules(namespace: str, *, admission_owner: str | None = None, cluster: bool = False,
          shared_budgets: bool = False) -> dict[Role, AclRule]:
    """Return each role's rule for bus namespace `namespace`.

    `admission_owner`: the `--owner` of the one admission process, whose token stream alone it may read
    (None: every `tokens:*` stream, for several admission processes sharing the user). `cluster`: allow
    what a Redis Cluster client needs. `shared_budgets`: admission may also run the one script of
    admission_svc/shares.py on the `budgets` hash (EVALSHA, SCRIPT LOAD, and the hash commands it calls). Raises ValueError for an empty namespace or one with `:{}`.
    """
    if not namespace or any(c in namespace for c in ":{}"):
        raise ValueError(f"namespace must be non-empty and contain no ':', '{{' or '}}', got {namespace!r}")
    ns = _glob_escape(namespace)
    kv_all = f"sluice:{{{ns}:kv:*"  # every shard and its dead letters
    tokens = (_glob_escape(key_of(namespace, f"tokens:{admission_owner}")) if admission_owner
              else f"sluice:{{{ns}:tokens:*}}")
    completions = _stream_and_dead(namespace, "completions")
    base = CONNECT_COMMANDS + (CLUSTER_COMMANDS if cluster else ())
    shares = (_glob_escape(key_of(namespace, "budgets")),) if shared_budgets else ()
    # A script runs with its caller's rights: the commands it calls must be allowed too (on the budgets key only).
    share_commands = ("evalsha", "script|load", "time", "hget", "hgetall", "hset", "hdel") if shared_budgets else ()
    return {
        Role.SCHEDULER: AclRule(Role.SCHEDULER.value, (kv_all, completions[0], f"sluice:{{{ns}:tokens:*}}"),
                                ("xadd", *base)),
        Role.ROUTER: AclRule(Role.ROUTER.value, (kv_all, *completions), (*CONSUME_COMMANDS, *base)),
        Role.ADMISSION: AclRule(Role.ADMISSION.value, (*completions, tokens, *shares),
                                (*CONSUME_COMMANDS, "xread", *base, *share_commands)),
    }


def _hash(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def _check_password(password: str) -> None:
    if not password or any(c.isspace() or ord(c) < 32 for c in password):
        raise ValueError("Redis ACL passwords must be non-empty, without spaces or control characters")


def acl_file_text(role_rules: Mapping[Role, AclRule], passwords: Mapping[Role, str], admin_password: str) -> str:
    """Return an ACL file (`aclfile` in redis.conf): the `default` user as the operator (every key and
    command, `admin_password`) and one user per rule; passwords only as SHA-256 hashes.

    Raises KeyError for a rule without a password, ValueError for a password with spaces or control characters.
    """
    _check_password(admin_password)
    lines = [f"user default on #{_hash(admin_password)} ~* &* +@all"]
    for role, rule in role_rules.items():
        _check_password(passwords[role])
        lines.append(" ".join(["user", rule.user, "reset", "on", f"#{_hash(passwords[role])}", *rule.tokens()]))
    return "\n".join(lines) + "\n"


def acl_setuser_commands(role_rules: Mapping[Role, AclRule], passwords: Mapping[Role, str]) -> list[list[str]]:
    """Return one `ACL SETUSER` command (as arguments) per rule, for an operator's own Redis (passwords hashed).

    Raises KeyError for a rule without a password, ValueError for a malformed password.
    """
    out = []
    for role, rule in role_rules.items():
        _check_password(passwords[role])
        out.append(["ACL", "SETUSER", rule.user, "reset", "on", f"#{_hash(passwords[role])}", *rule.tokens()])
    return out


def user_url(url: str, user: str, password: str) -> str:
    """Return `url` with its credentials replaced by `user:password` (both quoted), the rest kept."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (
        f":{parts.port}" if parts.port is not None else "")
    return urlunsplit(parts._replace(netloc=netloc))
