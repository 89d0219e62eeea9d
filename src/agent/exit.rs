//! The agent's exit codes: the task's own code after a run that ended by
//! itself, and codes of the agent's own for every other ending, placed
//! where `docker run` (125 to 127) and GNU `timeout` (124 to 127) place
//! theirs, so that a supervisor can tell them apart from the usual codes
//! of a program. The table is in `taskgate agent --help` and in
//! docs/agent-protocol.md ("Exit codes"), which a test holds to this one.

/// No server took the report of how the task ended within
/// `--shutdown-timeout` after a signal: the task is stopped, but the
/// server may still show it running.
pub const UNREACHABLE: i32 = 120;
/// The server declared the task lost: its process was stopped, and no
/// report of it is taken.
pub const LOST: i32 = 121;
/// The server told the task to stop (`desired: stop`): it was stopped and
/// reported dead, or never started. Also: the server ended this agent's
/// run (`run_superseded`: the task was stopped, nothing more reported),
/// or found the task dead with no order to run it again (`task_dead`).
pub const STOP_ORDER: i32 = 122;
/// The allocation was deleted while the task ran (it was stopped) or
/// before it ran.
pub const DELETED: i32 = 123;
/// The task was not ready within `--ready-timeout`, was killed, and the
/// restart policy did not run it again.
pub const NOT_READY: i32 = 124;
/// The agent's configuration, or a request the server refuses for good:
/// a flag, the token, the allocation, the spec (the log says which).
pub const CONFIG: i32 = 125;
/// The command is there but cannot be run (not an executable file).
pub const CANNOT_RUN: i32 = 126;
/// The command was not found.
pub const NOT_FOUND: i32 = 127;
/// A second signal: everything the task started was killed at once.
pub const SECOND_SIGNAL: i32 = 130;

/// The table as `taskgate agent --help` shows it.
pub const TABLE: &str = "\
Exit codes:
  After a run that ended by itself, the task's own exit code (128+N when
  signal N ended it), which may coincide with one below; the last log line
  says which. Otherwise:
  0    the task ran and exited 0, or the agent was stopped by a signal (the
       task, if it ran, was stopped and reported dead; if it had not run,
       nothing was reported)
  120  no server took the report of the task's end within --shutdown-timeout
  121  the server declared the task lost; it was stopped, nothing reported
  122  stopped by the server: an order (desired: stop), before or while it
       ran; its run ended by the server (run_superseded); or the task was
       dead with no order to run it again (task_dead)
  123  the allocation was deleted while the task ran, or before it ran
  124  not ready within --ready-timeout: killed, and not run again
  125  the configuration, or a request the server refuses for good (a flag,
       the token, the allocation, the spec)
  126  the command cannot be run (not an executable file)
  127  the command was not found
  130  a second signal: everything the task started was killed at once";
