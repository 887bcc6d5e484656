//! The few Redis commands replica sync sends, over RESP2 on one TCP
//! connection: `AUTH`, `SELECT`, `XADD`, `XREAD`, `XRANGE`.
//!
//! Every reply is bounded: a bulk string over [`MAX_BULK`] or an array over
//! [`MAX_ARRAY`] elements is an error, so a misbehaving server cannot make a
//! replica allocate without limit.

use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Largest bulk string accepted (one published batch is far smaller).
pub const MAX_BULK: usize = 64 << 20;
/// Most elements of one reply array.
pub const MAX_ARRAY: usize = 1 << 20;

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum RespError {
    /// The connection failed.
    #[error("redis connection")]
    Io(#[from] std::io::Error),
    /// The server did not answer in time.
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    /// The server answered with an error.
    #[error("redis error: {0}")]
    Server(String),
    /// The reply is not RESP2, or over the bounds.
    #[error("malformed redis reply: {0}")]
    Protocol(&'static str),
    /// The URL is not `redis://[:password@]host[:port][/db]`.
    #[error("replica sync URL {0:?} is not redis://[:password@]host[:port][/db]")]
    Url(String),
}

/// A RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `+OK` and other status lines.
    Status(String),
    /// An integer.
    Int(i64),
    /// A bulk string (`None`: the null bulk string).
    Bulk(Option<Vec<u8>>),
    /// An array (`None`: the null array, e.g. `XREAD` timing out).
    Array(Option<Vec<Value>>),
}

impl Value {
    /// The elements of an array reply (empty for the null array).
    pub fn into_array(self) -> Result<Vec<Value>, RespError> {
        match self {
            Value::Array(a) => Ok(a.unwrap_or_default()),
            _ => Err(RespError::Protocol("expected an array")),
        }
    }

    /// The bytes of a bulk string reply.
    pub fn into_bytes(self) -> Result<Vec<u8>, RespError> {
        match self {
            Value::Bulk(Some(b)) => Ok(b),
            _ => Err(RespError::Protocol("expected a bulk string")),
        }
    }
}

/// Where the server is: `redis://[:password@]host[:port][/db]`.
#[derive(Clone, PartialEq, Eq)]
pub struct Target {
    /// `host:port`.
    pub addr: String,
    /// `AUTH` password, if any.
    pub password: Option<String>,
    /// Database number (`SELECT`), if not 0.
    pub db: Option<u32>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("addr", &self.addr)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("db", &self.db)
            .finish()
    }
}

impl Target {
    /// Parses a `redis://` URL.
    pub fn parse(url: &str) -> Result<Target, RespError> {
        let bad = || RespError::Url(url.split('@').next_back().unwrap_or("").to_string());
        let rest = url.strip_prefix("redis://").ok_or_else(bad)?;
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((a, r)) => (Some(a), r),
            None => (None, rest),
        };
        let password = auth
            .map(|a| a.split_once(':').map_or(a, |(_, p)| p).to_string())
            .filter(|p| !p.is_empty());
        let (host, db) = match rest.split_once('/') {
            Some((h, "")) => (h, None),
            Some((h, d)) => (h, Some(d.parse::<u32>().map_err(|_| bad())?)),
            None => (rest, None),
        };
        if host.is_empty() {
            return Err(bad());
        }
        let has_port = match host.starts_with('[') {
            true => host.contains("]:"),
            false => host.contains(':'),
        };
        let addr = match has_port {
            true => host.to_string(),
            false => format!("{host}:6379"),
        };
        Ok(Target {
            addr,
            password,
            db: db.filter(|&d| d != 0),
        })
    }
}

/// One connection.
#[derive(Debug)]
pub struct Conn {
    io: BufReader<TcpStream>,
    timeout: Duration,
}

impl Conn {
    /// Connects (and authenticates, selects the database); every later
    /// command fails after `timeout` plus its own blocking time.
    pub async fn open(target: &Target, timeout: Duration) -> Result<Conn, RespError> {
        let stream = tokio::time::timeout(timeout, TcpStream::connect(&target.addr))
            .await
            .map_err(|_| RespError::Timeout(timeout))??;
        stream.set_nodelay(true)?;
        let mut c = Conn {
            io: BufReader::with_capacity(64 << 10, stream),
            timeout,
        };
        if let Some(p) = &target.password {
            c.cmd(&[b"AUTH", p.as_bytes()], Duration::ZERO).await?;
        }
        if let Some(db) = target.db {
            c.cmd(&[b"SELECT", db.to_string().as_bytes()], Duration::ZERO)
                .await?;
        }
        Ok(c)
    }

    /// Sends one command and reads its reply, allowing `blocking` beyond the
    /// connection's timeout (for `XREAD BLOCK`).
    pub async fn cmd(&mut self, args: &[&[u8]], blocking: Duration) -> Result<Value, RespError> {
        let limit = self.timeout + blocking;
        tokio::time::timeout(limit, async {
            let mut out = Vec::with_capacity(16 + args.iter().map(|a| a.len() + 16).sum::<usize>());
            out.extend_from_slice(format!("*{}\r\n", args.len()).as_bytes());
            for a in args {
                out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                out.extend_from_slice(a);
                out.extend_from_slice(b"\r\n");
            }
            self.io.get_mut().write_all(&out).await?;
            read_value(&mut self.io).await
        })
        .await
        .map_err(|_| RespError::Timeout(limit))?
    }
}

/// Reads one reply (nested arrays iteratively bounded by [`MAX_ARRAY`] each).
async fn read_value(io: &mut BufReader<TcpStream>) -> Result<Value, RespError> {
    let line = read_line(io).await?;
    let (kind, rest) = line
        .split_first()
        .ok_or(RespError::Protocol("empty line"))?;
    let text = || String::from_utf8_lossy(rest).into_owned();
    let int = || -> Result<i64, RespError> {
        std::str::from_utf8(rest)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or(RespError::Protocol("bad integer"))
    };
    match kind {
        b'+' => Ok(Value::Status(text())),
        b'-' => Err(RespError::Server(text())),
        b':' => Ok(Value::Int(int()?)),
        b'$' => {
            let n = int()?;
            if n < 0 {
                return Ok(Value::Bulk(None));
            }
            let n = usize::try_from(n).map_err(|_| RespError::Protocol("bad length"))?;
            if n > MAX_BULK {
                return Err(RespError::Protocol("bulk string over the bound"));
            }
            let mut b = vec![0; n + 2];
            io.read_exact(&mut b).await?;
            b.truncate(n);
            Ok(Value::Bulk(Some(b)))
        }
        b'*' => {
            let n = int()?;
            if n < 0 {
                return Ok(Value::Array(None));
            }
            let n = usize::try_from(n).map_err(|_| RespError::Protocol("bad length"))?;
            if n > MAX_ARRAY {
                return Err(RespError::Protocol("array over the bound"));
            }
            let mut a = Vec::with_capacity(n.min(1024));
            for _ in 0..n {
                a.push(Box::pin(read_value(io)).await?);
            }
            Ok(Value::Array(Some(a)))
        }
        _ => Err(RespError::Protocol("unknown reply type")),
    }
}

/// One CRLF-terminated line, without the CRLF (at most 64 KiB).
async fn read_line(io: &mut BufReader<TcpStream>) -> Result<Vec<u8>, RespError> {
    let mut line = Vec::new();
    let n = (&mut *io)
        .take(64 << 10)
        .read_until(b'\n', &mut line)
        .await?;
    if n == 0 {
        return Err(RespError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    if !line.ends_with(b"\r\n") {
        return Err(RespError::Protocol("line without CRLF"));
    }
    line.truncate(line.len() - 2);
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse() {
        let t = Target::parse("redis://10.0.0.1:7000/2").unwrap();
        assert_eq!(
            (t.addr.as_str(), t.password, t.db),
            ("10.0.0.1:7000", None, Some(2))
        );
        let t = Target::parse("redis://:secret@sync").unwrap();
        assert_eq!(t.addr, "sync:6379");
        assert_eq!(t.password.as_deref(), Some("secret"));
        assert!(!format!("{t:?}").contains("secret"));
        assert!(Target::parse("nats://x").is_err());
        assert!(Target::parse("redis://").is_err());
        let e = Target::parse("http://u:pw@h").unwrap_err().to_string();
        assert!(!e.contains("pw"), "{e}");
    }
}
