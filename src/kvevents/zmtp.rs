//! A ZMTP 3.0 client over TCP (NULL mechanism) for SUB and DEALER sockets, with a
//! maximum message size enforced before anything is allocated.
//!
//! Why our own framing instead of the `zeromq` crate's sockets: that crate (0.7)
//! has no maximum message size. Its codec accepts any 64-bit frame length and
//! reserves it at once, so one frame header from a publisher aborts the process on
//! allocation failure, and frames flagged MORE accumulate without end. Its codec is
//! internal to its sockets, so it cannot be wrapped; libzmq's `ZMQ_MAXMSGSIZE`
//! (through the `zmq` crate) would bring a C++ build and a dynamic libzmq into a
//! static binary. kvpick only ever connects one SUB (or DEALER) to one engine
//! socket, which is a small part of ZMTP: the greeting, the READY handshake and
//! length-prefixed frames (RFC 23, ZMTP 3.0). Speaking 3.0 makes peers (libzmq
//! 4.x, which vLLM and SGLang use through pyzmq) take subscriptions as messages
//! starting with byte 1.
//!
//! Every limit is checked on the declared length, before reading the body: a
//! message's frames together may not exceed [`Limits::max_message_bytes`], nor
//! number more than [`Limits::max_frames`]. A violation ends the connection with
//! an error; the caller reconnects with backoff.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// How much one message may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Sum of a message's frame lengths.
    pub max_message_bytes: usize,
    /// Frames in one message.
    pub max_frames: usize,
}

/// Why a ZMTP connection failed or ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The socket failed or the peer closed it.
    #[error("ZMTP connection I/O")]
    Io(#[from] std::io::Error),
    /// Connecting and the handshake took longer than allowed.
    #[error("ZMTP connect or handshake timed out")]
    Timeout(#[source] tokio::time::error::Elapsed),
    /// The peer's greeting is not ZMTP 3 with the NULL mechanism.
    #[error("peer greeting is not ZMTP 3 NULL")]
    Greeting,
    /// The peer's first command is not READY.
    #[error("peer did not send READY")]
    NotReady,
    /// A message declared more bytes than allowed.
    #[error("message of at least {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Bytes the message declared so far.
        len: u64,
        /// The limit.
        max: usize,
    },
    /// A message has more frames than allowed.
    #[error("message has more than {max} frames")]
    TooManyFrames {
        /// The limit.
        max: usize,
    },
}

const FLAG_MORE: u8 = 0b001;
const FLAG_LONG: u8 = 0b010;
const FLAG_COMMAND: u8 = 0b100;

/// An open, handshaken ZMTP connection.
pub struct Connection {
    stream: BufReader<TcpStream>,
    limits: Limits,
}

/// Our 64-byte greeting: version 3.0, mechanism NULL, not a server.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// A READY command body naming `socket_type`.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    body
}

fn encode_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    match u8::try_from(body.len()) {
        Ok(n) => out.extend_from_slice(&[flags, n]),
        Err(_) => {
            out.push(flags | FLAG_LONG);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
}

impl Connection {
    /// Connects to `addr` as `socket_type` ("SUB" or "DEALER") and completes the
    /// handshake within `timeout`.
    pub async fn connect(
        addr: SocketAddr,
        socket_type: &str,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Self, ZmtpError> {
        tokio::time::timeout(timeout, Self::handshake(addr, socket_type, limits))
            .await
            .map_err(ZmtpError::Timeout)?
    }

    async fn handshake(
        addr: SocketAddr,
        socket_type: &str,
        limits: Limits,
    ) -> Result<Self, ZmtpError> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let mut conn = Connection {
            stream: BufReader::new(stream),
            limits,
        };
        conn.stream.get_mut().write_all(&greeting()).await?;
        let mut peer = [0u8; 64];
        conn.stream.read_exact(&mut peer).await?;
        if peer[0] != 0xff || peer[9] != 0x7f || peer[10] < 3 || &peer[12..17] != b"NULL\0" {
            return Err(ZmtpError::Greeting);
        }
        let mut out = Vec::new();
        encode_frame(&mut out, FLAG_COMMAND, &ready(socket_type));
        conn.stream.get_mut().write_all(&out).await?;
        let (command, _, body) = conn.read_any(0).await?;
        if !command || !body.starts_with(b"\x05READY") {
            return Err(ZmtpError::NotReady);
        }
        Ok(conn)
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        let mut out = Vec::new();
        for (i, f) in frames.iter().enumerate() {
            let more = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            encode_frame(&mut out, more, f);
        }
        self.stream.get_mut().write_all(&out).await?;
        Ok(())
    }

    /// Subscribes to every topic (a SUB socket's message `[1]`).
    pub async fn subscribe_all(&mut self) -> Result<(), ZmtpError> {
        self.send(&[&[1]]).await
    }

    /// Receives the next message; commands between messages are skipped.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut frames = Vec::new();
        let mut total = 0usize;
        loop {
            let (command, more, body) = self.read_any(total).await?;
            if command {
                continue;
            }
            total += body.len();
            if frames.len() == self.limits.max_frames {
                return Err(ZmtpError::TooManyFrames {
                    max: self.limits.max_frames,
                });
            }
            frames.push(body);
            if !more {
                return Ok(frames);
            }
        }
    }

    /// Reads one frame whose message already holds `already` bytes: (is a
    /// command, has MORE, body). The length is checked before the body is read.
    async fn read_any(&mut self, already: usize) -> Result<(bool, bool, Bytes), ZmtpError> {
        let flags = self.stream.read_u8().await?;
        let len = if flags & FLAG_LONG != 0 {
            self.stream.read_u64().await?
        } else {
            u64::from(self.stream.read_u8().await?)
        };
        let max = self.limits.max_message_bytes;
        let total = len.saturating_add(already as u64);
        if total > max as u64 {
            return Err(ZmtpError::TooLarge { len: total, max });
        }
        // Fits in usize: it is at most `max`.
        let mut body = vec![0u8; len as usize];
        self.stream.read_exact(&mut body).await?;
        Ok((
            flags & FLAG_COMMAND != 0,
            flags & FLAG_MORE != 0,
            Bytes::from(body),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    const LIMITS: Limits = Limits {
        max_message_bytes: 1024,
        max_frames: 4,
    };

    /// A peer that greets, sends READY, then writes `then`.
    async fn peer(then: Vec<u8>) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(&greeting()).await.unwrap();
            let mut out = Vec::new();
            encode_frame(&mut out, FLAG_COMMAND, &ready("PUB"));
            out.extend_from_slice(&then);
            s.write_all(&out).await.unwrap();
            // Hold the connection open until the client is done.
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        });
        addr
    }

    async fn connect(addr: SocketAddr) -> Connection {
        Connection::connect(addr, "SUB", LIMITS, Duration::from_secs(5))
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_declared_length_past_the_maximum_fails_before_any_allocation() {
        let mut wire = vec![FLAG_LONG];
        wire.extend_from_slice(&(u64::MAX - 1).to_be_bytes());
        let mut c = connect(peer(wire).await).await;
        assert!(matches!(c.recv().await, Err(ZmtpError::TooLarge { .. })));
    }

    #[tokio::test]
    async fn frames_flagged_more_count_towards_one_message() {
        let mut wire = Vec::new();
        for _ in 0..3 {
            encode_frame(&mut wire, FLAG_MORE, &[7; 400]);
        }
        let mut c = connect(peer(wire).await).await;
        assert!(matches!(c.recv().await, Err(ZmtpError::TooLarge { .. })));

        let mut wire = Vec::new();
        for _ in 0..5 {
            encode_frame(&mut wire, FLAG_MORE, b"");
        }
        let mut c = connect(peer(wire).await).await;
        assert!(matches!(
            c.recv().await,
            Err(ZmtpError::TooManyFrames { max: 4 })
        ));
    }

    #[tokio::test]
    async fn messages_within_the_limits_arrive_whole() {
        let mut wire = Vec::new();
        encode_frame(&mut wire, FLAG_MORE, b"topic");
        encode_frame(&mut wire, FLAG_MORE, &7u64.to_be_bytes());
        encode_frame(&mut wire, 0, &[9; 300]);
        let mut c = connect(peer(wire).await).await;
        let m = c.recv().await.unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(&m[0][..], b"topic");
        assert_eq!(m[2].len(), 300);
    }

    #[tokio::test]
    async fn a_peer_that_is_not_zmtp_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(&[0x42; 64]).await.unwrap();
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        });
        let r = Connection::connect(addr, "SUB", LIMITS, Duration::from_secs(5)).await;
        assert!(matches!(r, Err(ZmtpError::Greeting)));
    }
}
