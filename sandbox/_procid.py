"""Who a process is, as root inside a sandbox sees it: its pid *and* its start time.

Root never signals (or spares) a pid it read from a place the agent can write, and never trusts a
pid alone: a pid file outlives its process, and an agent that cycles pids can take the number.  Each
record root keeps is ``<pid> <start time>`` (field 22 of ``/proc/<pid>/stat``, clock ticks since
boot), written by root into a directory only root can write; before it acts, it checks that
``/proc/<pid>`` is still that process (same start time and, where it matters, uid 0).  These are
POSIX shell snippets (builtins only), shared by the backends that run them inside a container.
"""

from __future__ import annotations

#: Where the root side of each command keeps its record (0700, root's): never the agent's /tmp.
EXEC_DIR = "/.ares/exec"

#: ``_ares_start "$(line of /proc/PID/stat)"`` sets ``t`` to that process's start time.  The command
#: name (field 2) may hold spaces and parentheses: everything up to the last ``) `` is dropped.
START_FN = '_ares_start() { _s=${1##*) }; set -- $_s; t=${20}; }; '

#: ``_ares_same PID START [1]`` succeeds when ``/proc/PID`` is the process recorded as ``PID START``
#: (and, with ``1``, runs with every uid 0: a setuid program the agent started is not root's).
SAME_FN = (
    START_FN
    + '_ares_same() { _l=; [ -n "$1" ] && [ -n "$2" ] || return 1; '
    'read -r _l <"/proc/$1/stat" 2>/dev/null || return 1; _ares_start "$_l"; [ "$t" = "$2" ] || return 1; '
    '[ "$3" = 1 ] || return 0; _u=; while read -r _k _a _b _c _d; do case $_k in Uid:) _u="$_a $_b $_c '
    '$_d"; break;; esac; done <"/proc/$1/status" 2>/dev/null; [ "$_u" = "0 0 0 0" ]; }; '
)

#: Run as ``sh -c RECORD_AND_EXEC RECORD-FILE ARGV...`` by root: writes ``<its pid> <its start time>``
#: to the record file, then execs ARGV (which switches to the command's user), keeping pid and start
#: time, so the record names the command's session leader.
RECORD_AND_EXEC = (
    START_FN
    + 'l=; read -r l </proc/self/stat; _ares_start "$l"; r=$0; echo "$$ $t" >"$r" || exit 125; exec "$@"'
)

#: Sets ``u`` (a user name or a numeric uid, as ``exec(user=...)`` takes it) to the name
#: ``/etc/passwd`` gives a numeric uid, builtins only: ``runuser -u`` and ``su`` take names alone.
#: A uid with no entry stays a number; ``sudo_u`` is ``u`` as ``sudo -u`` takes it (``#UID`` then).
USER_NAME_SH = (
    'case $u in ""|*[!0-9]*) ;; *) while IFS=: read -r _n _ _i _; do [ "$_i" = "$u" ] && { u=$_n; break; }; '
    'done 2>/dev/null </etc/passwd;; esac; '
    'case $u in ""|*[!0-9]*) sudo_u=$u;; *) sudo_u="#$u";; esac; '
)

#: Sets ``_ed`` to the directory of the records of the user it runs as (root: EXEC_DIR; a backend's
#: non-root default user with sudo: its own ``~/.ares-exec``), made 0700 when missing; builtins only.
EXEC_DIR_SH = (
    '_uid=; while read -r _k _v _; do case $_k in Uid:) _uid=$_v; break;; esac; done </proc/self/status; '
    f'if [ "$_uid" = 0 ]; then _ed={EXEC_DIR}; else _ed="${{HOME:-/tmp}}/.ares-exec"; fi; '
    '[ -d "$_ed" ] || mkdir -p -m 700 "$_ed" || exit 125; '
)

_KILL_BODY = (
    SAME_FN
    + 'p=; t0=; read -r p t0 <"$rec" 2>/dev/null; rm -f "$rec"; '
    'if _ares_same "$p" "$t0"; then kill -9 -"$p" 2>/dev/null || kill -9 "$p" 2>/dev/null '
    '|| sudo -n kill -9 -- -"$p" 2>/dev/null; fi; exit 0'
)
#: ``sh -c KILL_RECORDED RECORD-FILE``, as root: SIGKILL the process group of the recorded session
#: leader, only while that very process still lives (same start time); removes the record.
KILL_RECORDED = 'rec=$0; ' + _KILL_BODY
#: ``sh -c KILL_TOKEN TOKEN``: the same for the record ``<EXEC_DIR_SH's directory>/TOKEN.pid``.
KILL_TOKEN = EXEC_DIR_SH + 'rec="$_ed/$0.pid"; ' + _KILL_BODY

#: In a kill-everything script: ``relays`` becomes the pids of the relays that are still the processes
#: their root-written ``/.ares/relay-<port>.id`` records name (start time and uid 0); ``keeper`` the
#: container's own keeper when ``$1`` (``"<pid> <start>"``, the host's record taken at start) still
#: names it.  A pid that merely sits in a file is spared by nothing.
KEEP_RECORDED = (
    SAME_FN
    + 'relays=; for f in /.ares/relay-*.id; do [ -f "$f" ] || continue; r=; rt=; read -r r rt <"$f" '
      '2>/dev/null; '
    '_ares_same "$r" "$rt" 1 && relays="$relays $r"; done; '
    'keeper=; set -- $keeper_record; _ares_same "$1" "$2" 1 && keeper=$1; '
)

#: Run by root in front of a relay it starts by ``exec`` (same pid and start time): records it as
#: ``/.ares/relay-$port.id``; a relay of the port recorded earlier (a dropped channel's, still
#: holding the port) is killed first, only while it is that very process.
RELAY_RECORD = (
    SAME_FN
    + 'id="$d/relay-$port.id"; p=; t0=; [ -f "$id" ] && read -r p t0 <"$id"; '
    'if _ares_same "$p" "$t0" 1; then kill -9 "$p"; i=0; '
    'while [ -d "/proc/$p" ] && [ $i -lt 40 ]; do sleep 0.05; i=$((i+1)); done; fi; '
    'l=; read -r l </proc/self/stat; _ares_start "$l"; echo "$$ $t" >"$id.tmp" && mv -f "$id.tmp" "$id"; '
)

#: ``sh -c KILL_ALL NAME UID ROUNDS [KEEPER-RECORD]``, as root inside a container: kills every process
#: (of user UID; '' = every user) but PID 1, the container's keeper when KEEPER-RECORD (``"<pid>
#: <start>"``, the host's record taken at start) still names it, the relays (each only while it is the
#: very process recorded: start time, uid 0) and this script with its ancestors (the exec wrapper above
#: it), in rounds of 50 ms, ROUNDS at most. Builtins only (but sleep), so the script's own helpers never
#: show up and no program is looked up while listing. Prints the number killed; exit 3 (and the
#: survivors) when time runs out.
KILL_ALL = r"""
want=$1; rounds=$2; keeper_record=$3; self=$$; killed=0
""" + KEEP_RECORDED + r"""
anc=""; p=$self
while [ -n "$p" ] && [ "$p" -gt 1 ]; do
  anc="$anc $p"; pp=""
  while read -r k v _; do case $k in PPid:) pp=$v; break;; esac; done <"/proc/$p/status" 2>/dev/null
  p=$pp
done
keep=" 1 $keeper $relays $anc "
n=0
while :; do
  list=""
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case "$keep" in *" $p "*) continue;; esac
    st=""; u=""
    while read -r k v _; do
      case $k in State:) st=$v;; Uid:) u=$v; break;; esac
    done <"$d/status" 2>/dev/null || continue
    case $st in Z|X|"") continue;; esac
    [ -n "$want" ] && [ "$u" != "$want" ] && continue
    list="$list $p"
  done
  [ -z "$list" ] && { echo "$killed"; exit 0; }
  n=$((n+1)); [ $n -gt "$rounds" ] && { echo "survivors:$list"; exit 3; }
  for p in $list; do kill -9 "$p" 2>/dev/null && killed=$((killed+1)); done
  sleep 0.05
done
"""
