//! A benchmarked ext_proc server as a child process: its port, CPU time and
//! peak memory from `/proc`, and its stop. Killed when dropped.

use std::process::Stdio;

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// A server child process of one (cell, server) run; killed when dropped.
pub struct ServerProcess {
    child: Child,
    /// Its ext_proc port on 127.0.0.1.
    pub port: u16,
    /// Started by [`ServerProcess::foreign`]: stopped with SIGTERM, whatever
    /// its exit status then.
    foreign: bool,
}

impl ServerProcess {
    /// Starts `command` (an `overhead-server`, possibly under a wrapper such as
    /// valgrind) and reads its port.
    pub async fn spawn(mut command: Command) -> anyhow::Result<Self> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {:?}", command.as_std().get_program()))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).await?;
        let port = line
            .trim()
            .parse()
            .with_context(|| format!("server printed {line:?}, not a port"))?;
        Ok(ServerProcess {
            child,
            port,
            foreign: false,
        })
    }

    /// Starts another program's ext_proc server, `command`, that serves on
    /// 127.0.0.1:`port` (the caller waits until it is ready).
    pub fn foreign(mut command: Command, port: u16) -> anyhow::Result<Self> {
        let child = command
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {:?}", command.as_std().get_program()))?;
        Ok(ServerProcess {
            child,
            port,
            foreign: true,
        })
    }

    /// The process's peak resident set (VmHWM) in bytes.
    pub fn peak_rss_bytes(&self) -> anyhow::Result<u64> {
        let pid = self.child.id().context("server already exited")?;
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
        vm_hwm_bytes(&status).context("no VmHWM line in /proc/<pid>/status")
    }

    /// The process's CPU time so far (user + system, all threads) in seconds.
    pub fn cpu_seconds(&self) -> anyhow::Result<f64> {
        let pid = self.child.id().context("server already exited")?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
        cpu_seconds(&stat).context("no utime/stime in /proc/<pid>/stat")
    }

    /// Closes its stdin (it then exits) and waits for it; a foreign server
    /// gets SIGTERM instead.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        if self.foreign {
            if let Some(pid) = self.child.id() {
                // SAFETY: kill(2) on the pid of our own child, which has not been reaped.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
            }
            self.child.wait().await?;
            return Ok(());
        }
        drop(self.child.stdin.take());
        let status = self.child.wait().await?;
        if !status.success() {
            bail!("server exited with {status}");
        }
        Ok(())
    }
}

/// Clock ticks per second of `/proc/<pid>/stat` times (`USER_HZ`, 100 on Linux).
const USER_HZ: f64 = 100.0;

/// utime + stime of a `/proc/<pid>/stat` text, in seconds.
pub fn cpu_seconds(stat: &str) -> Option<f64> {
    // Fields after the command name (which may hold spaces) start at `state`.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / USER_HZ)
}

/// `VmHWM` of a `/proc/<pid>/status` text, in bytes.
pub fn vm_hwm_bytes(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
