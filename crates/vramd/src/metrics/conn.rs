//! The metrics endpoint's connections, bounded: at most [`MAX_CONNECTIONS`] open at once, each
//! closed after [`IDLE`] without a byte either way. The endpoint shares the daemon's descriptor
//! table with the tenants' connections and grants, and anyone who reaches its port is a client,
//! so neither many connections nor one holding half a request may pin descriptors or the thread
//! that waits for the endpoint to stop.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::connect_info::Connected;
use axum::serve::{IncomingStream, Listener};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{sleep, Instant, Sleep};

/// Connections served at once; one more waits in the kernel's backlog until one closes.
pub const MAX_CONNECTIONS: usize = 64;

/// A connection with no byte read or written for this long is closed (a scraper opens another).
pub const IDLE: Duration = Duration::from_secs(30);

/// A TCP listener that accepts a connection only while fewer than [`MAX_CONNECTIONS`] are open.
pub struct Bounded {
    listener: TcpListener,
    open: Arc<Semaphore>,
    idle: Duration,
}

impl Bounded {
    pub fn new(listener: TcpListener, max: usize, idle: Duration) -> Bounded {
        Bounded {
            listener,
            open: Arc::new(Semaphore::new(max)),
            idle,
        }
    }
}

impl Listener for Bounded {
    type Io = Counted;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Counted, SocketAddr) {
        // The semaphore is never closed, so acquiring only waits.
        let permit = loop {
            if let Ok(p) = self.open.clone().acquire_owned().await {
                break p;
            }
        };
        loop {
            match self.listener.accept().await {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    return (Counted::new(stream, permit, self.idle), peer);
                }
                Err(e) => {
                    // Out of descriptors or memory, or a connection reset before it was taken:
                    // wait rather than spin, and serve on once it passes.
                    tracing::warn!("metrics endpoint cannot accept a connection: {e}");
                    sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// The peer's address, as `ConnectInfo` gives it to a handler.
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub SocketAddr);

impl Connected<IncomingStream<'_, Bounded>> for Peer {
    fn connect_info(stream: IncomingStream<'_, Bounded>) -> Peer {
        Peer(*stream.remote_addr())
    }
}

/// An accepted connection holding its place among the open ones until it is dropped, and failing
/// with `TimedOut` once it has been idle for its limit.
pub struct Counted {
    stream: TcpStream,
    _open: OwnedSemaphorePermit,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl Counted {
    fn new(stream: TcpStream, open: OwnedSemaphorePermit, idle: Duration) -> Counted {
        Counted {
            stream,
            _open: open,
            idle,
            deadline: Box::pin(sleep(idle)),
        }
    }

    /// A read's or write's outcome: done, the connection counts as active again; pending, it
    /// waits until the deadline, then fails with `TimedOut`.
    fn polled<T>(&mut self, cx: &mut Context<'_>, p: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match p {
            Poll::Ready(r) => {
                self.deadline.as_mut().reset(Instant::now() + self.idle);
                Poll::Ready(r)
            }
            Poll::Pending => match self.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("idle for {:?}", self.idle),
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl AsyncRead for Counted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.stream).poll_read(cx, buf);
        this.polled(cx, p)
    }
}

impl AsyncWrite for Counted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.polled(cx, p)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.stream).poll_flush(cx);
        this.polled(cx, p)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.polled(cx, p)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// With one connection allowed, a client holding half a request keeps the next waiting only
    /// until it has been idle for the limit; then the next is served.
    #[test]
    fn connections_are_bounded_and_an_idle_one_is_closed() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let idle = Duration::from_millis(300);
            let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
            tokio::spawn(async move {
                axum::serve(Bounded::new(l, 1, idle), app).await.unwrap();
            });
            let mut half = TcpStream::connect(addr).await.unwrap();
            half.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;

            let started = Instant::now();
            let mut next = TcpStream::connect(addr).await.unwrap();
            next.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            let mut answer = String::new();
            next.read_to_string(&mut answer).await.unwrap();
            let waited = started.elapsed();
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(
                waited >= idle / 2,
                "served after {waited:?}: the first connection's place was free"
            );
            // The idle one was closed: reading it ends.
            let mut rest = Vec::new();
            let closed =
                tokio::time::timeout(Duration::from_secs(5), half.read_to_end(&mut rest)).await;
            assert!(closed.is_ok(), "the idle connection is still open");
        });
    }
}
