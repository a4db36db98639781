//! A framed connection over a Unix stream socket, with file descriptors passed as `SCM_RIGHTS`.
//!
//! Sending and receiving take `&self`, each behind its own lock, so one thread can read while
//! others write (the daemon's reclaim requests, a tenant's allocator threads).
//!
//! Deadlines: once a frame's first byte has arrived, the whole frame must arrive within the frame
//! timeout ([`Conn::with_frame_timeout`]); a receiver may also bound the wait for a frame to start
//! ([`Conn::recv_within`]). A connection built [`Conn::with_send_timeout`] gives each frame it
//! sends that long to be taken by the peer, and [`Conn::try_send`] never waits for a peer at all.

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, TryLockError};
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::frame::{FrameHeader, HEADER_LEN};
use crate::message::Envelope;
use crate::{ProtoError, MAX_FDS, MAX_PAYLOAD, PROTOCOL_VERSION};

/// How long a peer may take to send one whole frame, from its first byte.
pub const DEFAULT_FRAME_TIMEOUT: Duration = Duration::from_secs(5);

/// A decoded frame and the file descriptors that came with it.
#[derive(Debug)]
pub struct Received<T> {
    pub id: u64,
    pub msg: T,
    pub fds: Vec<OwnedFd>,
}

#[derive(Debug)]
struct Rx {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    fds: VecDeque<OwnedFd>,
}

/// A framed, fd-passing connection. See the crate docs for the frame layout.
#[derive(Debug)]
pub struct Conn {
    stream: UnixStream,
    tx: Mutex<()>,
    rx: Mutex<Rx>,
    frame_timeout: Duration,
    /// Set: every frame sent must be taken by the peer within this (`SO_SNDTIMEO` carries it).
    send_timeout: Option<Duration>,
}

/// How a send may wait for the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// Up to the send timeout (forever without one).
    Bounded,
    /// Not at all for the frame to start: a full socket or a busy sender is
    /// [`ProtoError::WouldBlock`] with nothing sent.
    Never,
}

/// The encoded length of `msg` as the payload of a frame with id `id`: whether it fits
/// [`MAX_PAYLOAD`] before it is sent.
pub fn payload_len<T: Serialize>(id: u64, msg: &T) -> Result<usize, ProtoError> {
    postcard::experimental::serialized_size(&Envelope { id, msg })
        .map_err(|e| ProtoError::Decode(format!("cannot encode: {e}")))
}

impl Conn {
    pub fn new(stream: UnixStream) -> Conn {
        Conn {
            stream,
            tx: Mutex::new(()),
            rx: Mutex::new(Rx {
                buf: vec![0; 64 * 1024],
                start: 0,
                end: 0,
                fds: VecDeque::new(),
            }),
            frame_timeout: DEFAULT_FRAME_TIMEOUT,
            send_timeout: None,
        }
    }

    /// Sets how long a peer may take to send one whole frame, from its first byte.
    pub fn with_frame_timeout(mut self, timeout: Duration) -> Conn {
        self.frame_timeout = timeout;
        self
    }

    /// Bounds every send: a frame the peer does not take within `timeout` (it does not read) is
    /// [`ProtoError::SendTimeout`], and the connection is shut down, since the peer may have got
    /// part of the frame.
    pub fn with_send_timeout(mut self, timeout: Duration) -> std::io::Result<Conn> {
        self.stream.set_write_timeout(Some(timeout))?;
        self.send_timeout = Some(timeout);
        Ok(self)
    }

    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Sends one frame, with `fds` attached; waits up to the send timeout, if one is set.
    pub fn send<T: Serialize>(
        &self,
        id: u64,
        msg: &T,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ProtoError> {
        self.send_frame(id, msg, fds, Wait::Bounded)
    }

    /// Sends one frame without waiting for the peer: if another thread is sending on this
    /// connection, or the peer's socket has no room for it, nothing is sent and the answer is
    /// [`ProtoError::WouldBlock`]. A frame the socket takes only in part is finished within the
    /// send timeout (a frame a few dozen bytes long is taken whole or not at all).
    pub fn try_send<T: Serialize>(
        &self,
        id: u64,
        msg: &T,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ProtoError> {
        self.send_frame(id, msg, fds, Wait::Never)
    }

    fn send_frame<T: Serialize>(
        &self,
        id: u64,
        msg: &T,
        fds: &[BorrowedFd<'_>],
        wait: Wait,
    ) -> Result<(), ProtoError> {
        if fds.len() > MAX_FDS {
            return Err(ProtoError::TooManyFds {
                count: fds.len(),
                max: MAX_FDS,
            });
        }
        let payload = postcard::to_stdvec(&Envelope { id, msg })
            .map_err(|e| ProtoError::Decode(format!("cannot encode: {e}")))?;
        if payload.len() > MAX_PAYLOAD {
            return Err(ProtoError::Oversized {
                len: payload.len(),
                max: MAX_PAYLOAD,
            });
        }
        let header = FrameHeader::new(fds.len(), payload.len()).encode();
        let _guard = match wait {
            Wait::Bounded => self.tx.lock().unwrap_or_else(|p| p.into_inner()),
            Wait::Never => match self.tx.try_lock() {
                Ok(g) => g,
                Err(TryLockError::Poisoned(p)) => p.into_inner(),
                Err(TryLockError::WouldBlock) => return Err(ProtoError::WouldBlock),
            },
        };
        self.send_raw(&header, &payload, fds, wait)
    }

    /// Writes bytes as they are, for tests that must send malformed frames.
    pub fn send_bytes(&self, bytes: &[u8]) -> Result<(), ProtoError> {
        let _guard = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        self.send_raw(bytes, &[], &[], Wait::Bounded)
    }

    fn send_raw(
        &self,
        a: &[u8],
        b: &[u8],
        fds: &[BorrowedFd<'_>],
        wait: Wait,
    ) -> Result<(), ProtoError> {
        let total = a.len() + b.len();
        let mut sent = 0;
        let started = Instant::now();
        // Whether SO_SNDTIMEO was shortened to what is left of the frame's time.
        let mut shortened = false;
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        let result = loop {
            if sent == total {
                break Ok(());
            }
            let mut control = SendAncillaryBuffer::new(&mut space);
            // The descriptors ride with the frame's first byte, and only once.
            if sent == 0 && !fds.is_empty() {
                control.push(SendAncillaryMessage::ScmRights(fds));
            }
            let (ia, ib) = if sent < a.len() {
                (&a[sent..], b)
            } else {
                (&[][..], &b[sent - a.len()..])
            };
            let iov = [IoSlice::new(ia), IoSlice::new(ib)];
            let mut flags = SendFlags::NOSIGNAL;
            if sent == 0 && wait == Wait::Never {
                flags |= SendFlags::DONTWAIT;
            }
            match rustix::net::sendmsg(&self.stream, &iov, &mut control, flags) {
                Ok(n) => sent += n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) if sent == 0 && wait == Wait::Never => {
                    break Err(ProtoError::WouldBlock)
                }
                Err(rustix::io::Errno::AGAIN) => break Err(self.send_timed_out(sent)),
                Err(e) => break Err(ProtoError::Io(e.into())),
            }
            if sent < total {
                if let Some(limit) = self.send_timeout {
                    // The rest of the frame gets what is left of its time, not a fresh timeout.
                    let left = limit.saturating_sub(started.elapsed());
                    if left.is_zero() {
                        break Err(self.send_timed_out(sent));
                    }
                    self.stream.set_write_timeout(Some(left))?;
                    shortened = true;
                }
            }
        };
        if shortened {
            // Best effort: the next frame gets the whole timeout again.
            let _ = self.stream.set_write_timeout(self.send_timeout);
        }
        result
    }

    /// The send timeout ran out with `sent` bytes of a frame taken: the stream can no longer be
    /// trusted, so it is shut down.
    fn send_timed_out(&self, sent: usize) -> ProtoError {
        if sent > 0 {
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
        }
        ProtoError::SendTimeout(self.send_timeout.unwrap_or_default())
    }

    /// Ends reading for good: the peer can send nothing more, and what it sent that was not
    /// read is dropped, with every descriptor it carried (queued here or still in the socket).
    /// Descriptors in flight keep the files they name open, so a connection that is over lets
    /// go of them before what they reach is counted free.
    pub fn discard_incoming(&self) {
        let _ = rustix::net::shutdown(&self.stream, rustix::net::Shutdown::Read);
        let mut rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        rx.fds.clear();
        rx.start = 0;
        rx.end = 0;
        let mut scratch = [0u8; 4096];
        loop {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let mut iov = [IoSliceMut::new(&mut scratch)];
            let flags = RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT;
            match rustix::net::recvmsg(&self.stream, &mut iov, &mut control, flags) {
                Ok(m) => {
                    // Dropped here, closed.
                    control.drain().for_each(drop);
                    if m.bytes == 0 {
                        return;
                    }
                }
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return,
            }
        }
    }

    /// Whether a whole frame (or a header [`Conn::recv`] would refuse) is already buffered, so that
    /// `recv` answers without waiting on the socket. Blocks while another thread is in `recv`.
    pub fn has_frame(&self) -> bool {
        let rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        let have = &rx.buf[rx.start..rx.end];
        let Some(header) = have.first_chunk::<HEADER_LEN>() else {
            return false;
        };
        match FrameHeader::decode(header) {
            Ok(h) => have.len() >= HEADER_LEN + h.len as usize,
            Err(_) => true,
        }
    }

    /// Receives one frame. Blocks until a frame starts; once it has, the rest must arrive within
    /// the frame timeout. A frame of another protocol version is read whole and reported as
    /// [`ProtoError::Version`], so the caller can still answer it.
    pub fn recv<T: DeserializeOwned>(&self) -> Result<Received<T>, ProtoError> {
        self.recv_within(None)
    }

    /// [`Conn::recv`], with the wait for a frame to start bounded by `idle`
    /// ([`ProtoError::Idle`] when nothing came).
    pub fn recv_within<T: DeserializeOwned>(
        &self,
        idle: Option<Duration>,
    ) -> Result<Received<T>, ProtoError> {
        let mut rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        let mut timer = ReadTimer {
            idle,
            frame_started: None,
            set: false,
        };
        let result = self.recv_locked(&mut rx, &mut timer);
        if timer.set {
            // Best effort: the next wait for a frame is not bounded unless its caller asks.
            let _ = self.stream.set_read_timeout(None);
        }
        result
    }

    fn recv_locked<T: DeserializeOwned>(
        &self,
        rx: &mut Rx,
        timer: &mut ReadTimer,
    ) -> Result<Received<T>, ProtoError> {
        self.fill(rx, HEADER_LEN, timer)?;
        let header: [u8; HEADER_LEN] = rx.buf[rx.start..rx.start + HEADER_LEN]
            .try_into()
            .expect("header length");
        let h = FrameHeader::decode(&header)?;
        let len = h.len as usize;
        self.fill(rx, HEADER_LEN + len, timer)?;
        let payload_at = rx.start + HEADER_LEN;
        rx.start = payload_at + len;
        let nfds = h.fds as usize;
        if rx.fds.len() < nfds {
            return Err(ProtoError::MissingFds {
                announced: nfds,
                received: rx.fds.len(),
            });
        }
        let fds: Vec<OwnedFd> = rx.fds.drain(..nfds).collect();
        // A frame's descriptors arrive with its first byte, never before it: once every byte read
        // is taken, a descriptor still queued was announced by no frame. It is closed, and so is
        // the connection: kept, it could be the peer's own end of this socket, whose close this
        // side would then never see.
        if rx.start == rx.end && !rx.fds.is_empty() {
            let count = rx.fds.len();
            rx.fds.clear();
            return Err(ProtoError::UnannouncedFds { count });
        }
        if h.version != PROTOCOL_VERSION {
            return Err(ProtoError::Version {
                theirs: h.version,
                ours: PROTOCOL_VERSION,
            });
        }
        let env: Envelope<T> = postcard::from_bytes(&rx.buf[payload_at..payload_at + len])
            .map_err(|e| ProtoError::Decode(e.to_string()))?;
        Ok(Received {
            id: env.id,
            msg: env.msg,
            fds,
        })
    }

    /// Sets the socket's read timeout for the next read: what is left of the frame's time once
    /// the frame has begun, else the idle bound if there is one.
    fn arm(&self, timer: &mut ReadTimer, begun: bool) -> Result<(), ProtoError> {
        let limit = if begun {
            let started = *timer.frame_started.get_or_insert_with(Instant::now);
            let left = self.frame_timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(ProtoError::Stalled(self.frame_timeout));
            }
            left
        } else {
            match timer.idle {
                Some(idle) if !timer.set => idle,
                _ => return Ok(()),
            }
        };
        self.stream.set_read_timeout(Some(limit))?;
        timer.set = true;
        Ok(())
    }

    /// Reads until `rx` holds at least `want` unread bytes.
    fn fill(&self, rx: &mut Rx, want: usize, timer: &mut ReadTimer) -> Result<(), ProtoError> {
        if rx.end - rx.start >= want {
            return Ok(());
        }
        if rx.buf.len() - rx.start < want {
            // Move the unread bytes to the front, growing the buffer if a frame needs it.
            rx.buf.copy_within(rx.start..rx.end, 0);
            rx.end -= rx.start;
            rx.start = 0;
            if rx.buf.len() < want {
                rx.buf.resize(want, 0);
            }
        }
        while rx.end - rx.start < want {
            let begun = rx.end > rx.start;
            self.arm(timer, begun)?;
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let end = rx.end;
            let mut iov = [IoSliceMut::new(&mut rx.buf[end..])];
            let got = match rustix::net::recvmsg(
                &self.stream,
                &mut iov,
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            ) {
                Ok(m) => m,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) if begun || timer.frame_started.is_some() => {
                    return Err(ProtoError::Stalled(self.frame_timeout))
                }
                Err(rustix::io::Errno::AGAIN) => {
                    return Err(match timer.idle {
                        Some(idle) => ProtoError::Idle(idle),
                        // A read timeout the caller set on the socket itself.
                        None => ProtoError::Io(std::io::ErrorKind::WouldBlock.into()),
                    });
                }
                Err(e) => return Err(ProtoError::Io(e.into())),
            };
            for msg in control.drain() {
                if let RecvAncillaryMessage::ScmRights(fds) = msg {
                    rx.fds.extend(fds);
                }
            }
            if got.flags.contains(ReturnFlags::CTRUNC) || rx.fds.len() > 4 * MAX_FDS {
                return Err(ProtoError::TooManyFds {
                    count: rx.fds.len(),
                    max: MAX_FDS,
                });
            }
            if got.bytes == 0 {
                let have = rx.end - rx.start;
                return Err(if have == 0 {
                    ProtoError::Closed
                } else {
                    ProtoError::Truncated { got: have, want }
                });
            }
            rx.end += got.bytes;
        }
        Ok(())
    }
}

/// The read timeouts one `recv` puts on the socket.
struct ReadTimer {
    /// The bound on the wait for a frame to start, if any.
    idle: Option<Duration>,
    /// When this frame's first byte was seen.
    frame_started: Option<Instant>,
    /// Whether a read timeout was set (and must be taken off at the end).
    set: bool,
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Seek, Write};
    use std::os::fd::AsFd;

    use super::*;
    use crate::message::{Reply, Request};

    fn pair() -> (Conn, Conn) {
        let (a, b) = UnixStream::pair().unwrap();
        (
            Conn::new(a),
            Conn::new(b).with_frame_timeout(Duration::from_millis(200)),
        )
    }

    #[test]
    fn messages_and_fds_arrive_in_order() {
        let (a, b) = pair();
        let mut files = Vec::new();
        for i in 0..3u8 {
            let mut f = tempfile::tempfile().unwrap();
            f.write_all(&[i; 4]).unwrap();
            files.push(f);
        }
        a.send(1, &Request::Ping, &[]).unwrap();
        a.send(2, &Request::Status, &[files[0].as_fd(), files[1].as_fd()])
            .unwrap();
        a.send(3, &Request::Ping, &[files[2].as_fd()]).unwrap();
        let r: Received<Request> = b.recv().unwrap();
        assert_eq!((r.id, r.msg, r.fds.len()), (1, Request::Ping, 0));
        let r: Received<Request> = b.recv().unwrap();
        assert_eq!((r.id, r.fds.len()), (2, 2));
        let r: Received<Request> = b.recv().unwrap();
        assert_eq!((r.id, r.fds.len()), (3, 1));
        let mut f = std::fs::File::from(r.fds.into_iter().next().unwrap());
        f.rewind().unwrap();
        let mut got = Vec::new();
        f.read_to_end(&mut got).unwrap();
        assert_eq!(got, vec![2; 4]);
    }

    #[test]
    fn has_frame_says_whether_recv_would_wait() {
        let (a, b) = pair();
        assert!(!b.has_frame());
        a.send(1, &Request::Ping, &[]).unwrap();
        a.send(2, &Request::Ping, &[]).unwrap();
        // Both frames arrive in one read; the second stays buffered.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(b.recv::<Request>().unwrap().id, 1);
        assert!(b.has_frame());
        assert_eq!(b.recv::<Request>().unwrap().id, 2);
        assert!(!b.has_frame());
    }

    #[test]
    fn malformed_payload_is_recoverable() {
        let (a, b) = pair();
        let mut frame = FrameHeader::new(0, 3).encode().to_vec();
        frame.extend_from_slice(&[0xff, 0xff, 0xff]);
        a.send_bytes(&frame).unwrap();
        a.send(9, &Request::Ping, &[]).unwrap();
        let e = b.recv::<Request>().unwrap_err();
        assert!(e.is_recoverable(), "{e}");
        assert_eq!(b.recv::<Request>().unwrap().id, 9);
    }

    #[test]
    fn bad_frames_are_refused() {
        let (a, b) = pair();
        a.send_bytes(b"GET / HTTP/1.1\r\n").unwrap();
        assert!(matches!(b.recv::<Request>(), Err(ProtoError::BadMagic(_))));

        let (a, b) = pair();
        a.send_bytes(&FrameHeader::new(0, MAX_PAYLOAD + 1).encode())
            .unwrap();
        assert!(matches!(
            b.recv::<Request>(),
            Err(ProtoError::Oversized { .. })
        ));

        let (a, b) = pair();
        let mut h = FrameHeader::new(0, 1);
        h.version = 99;
        let mut frame = h.encode().to_vec();
        frame.push(0);
        a.send_bytes(&frame).unwrap();
        assert!(matches!(
            b.recv::<Reply>(),
            Err(ProtoError::Version { theirs: 99, .. })
        ));
    }

    #[test]
    fn truncated_and_stalled_frames_end_the_wait() {
        let (a, b) = pair();
        a.send_bytes(&FrameHeader::new(0, 100).encode()).unwrap();
        a.send_bytes(&[1, 2, 3]).unwrap();
        // The peer stalls with the frame unfinished.
        assert!(matches!(b.recv::<Request>(), Err(ProtoError::Stalled(_))));
        drop(a);

        let (a, b) = pair();
        a.send_bytes(&FrameHeader::new(0, 100).encode()[..5])
            .unwrap();
        drop(a);
        assert!(matches!(
            b.recv::<Request>(),
            Err(ProtoError::Truncated { got: 5, .. })
        ));

        let (a, b) = pair();
        drop(a);
        assert!(matches!(b.recv::<Request>(), Err(ProtoError::Closed)));
    }

    /// A ping's frame whose header announces `fds` descriptors.
    fn ping_frame(fds: usize) -> Vec<u8> {
        let payload = postcard::to_stdvec(&Envelope {
            id: 1,
            msg: Request::Ping,
        })
        .unwrap();
        [&FrameHeader::new(fds, payload.len()).encode()[..], &payload].concat()
    }

    #[test]
    fn fds_no_frame_announced_are_an_error() {
        let (a, b) = pair();
        let frame = ping_frame(0);
        // The frame says it carries none; the peer's own end of the socket rides with it.
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        let fds = [a.stream().as_fd()];
        assert!(control.push(SendAncillaryMessage::ScmRights(&fds)));
        let iov = [IoSlice::new(&frame)];
        rustix::net::sendmsg(a.stream(), &iov, &mut control, SendFlags::empty()).unwrap();
        assert!(matches!(
            b.recv::<Request>(),
            Err(ProtoError::UnannouncedFds { count: 1 })
        ));
        // The descriptor is closed: the peer's close reaches this side.
        drop(a);
        assert!(matches!(b.recv::<Request>(), Err(ProtoError::Closed)));
    }

    #[test]
    fn fds_announced_but_missing_are_an_error() {
        let (a, b) = pair();
        a.send_bytes(&ping_frame(2)).unwrap();
        assert!(matches!(
            b.recv::<Request>(),
            Err(ProtoError::MissingFds { announced: 2, .. })
        ));
    }
}
