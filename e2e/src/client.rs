//! A minimal HTTP/1.1 client for the gateway, for tests and the demo.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// An answer.
#[derive(Debug, Clone)]
pub struct Reply {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// The whole body.
    pub body: Bytes,
    /// From sending the request to the first non-empty body chunk.
    pub first_chunk: Option<std::time::Duration>,
}

impl Reply {
    /// The body as JSON (`Value::Null` when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The assistant text of a chat completion (non-streaming or SSE).
    pub fn chat_text(&self) -> String {
        if let Some(s) = self.json()["choices"][0]["message"]["content"].as_str() {
            return s.to_string();
        }
        self.text()
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|l| *l != "[DONE]")
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter_map(|v| {
                v["choices"][0]["delta"]["content"]
                    .as_str()
                    .map(String::from)
            })
            .collect()
    }
}

/// Why a request failed below HTTP.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Connecting or sending failed.
    #[error("request failed")]
    Request(#[from] hyper_util::client::legacy::Error),
    /// Reading the body failed.
    #[error("body failed")]
    Body(#[from] hyper::Error),
    /// The request could not be built.
    #[error("bad request parts")]
    Build(#[from] http::Error),
}

/// A client bound to one address.
#[derive(Clone)]
pub struct Client {
    addr: SocketAddr,
    http: hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>,
}

impl Client {
    /// A client of `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        Client {
            addr,
            http: hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .build(crate::serve::nodelay_connector()),
        }
    }

    /// Sends a request with a raw body and extra headers.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Reply, ClientError> {
        let mut req = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let sent = std::time::Instant::now();
        let resp = self.http.request(req.body(Full::new(body.into()))?).await?;
        let (parts, mut body) = resp.into_parts();
        let mut bytes = Vec::new();
        let mut first_chunk = None;
        while let Some(frame) = body.frame().await {
            if let Ok(data) = frame?.into_data() {
                if !data.is_empty() && first_chunk.is_none() {
                    first_chunk = Some(sent.elapsed());
                }
                bytes.extend_from_slice(&data);
            }
        }
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body: bytes.into(),
            first_chunk,
        })
    }

    /// POSTs a JSON body.
    pub async fn post_json(
        &self,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> Result<Reply, ClientError> {
        self.send(Method::POST, path, headers, body.to_string())
            .await
    }

    /// GETs a path.
    pub async fn get(&self, path: &str) -> Result<Reply, ClientError> {
        self.send(Method::GET, path, &[], Bytes::new()).await
    }
}
