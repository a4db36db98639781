//! A framed connection over a Unix stream socket, with file descriptors passed as `SCM_RIGHTS`.
//!
//! Sending and receiving take `&self`, each behind its own lock, so one thread can read while
//! others write (the daemon's reclaim requests, a tenant's allocator threads).

use std::collections::VecDeque;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::frame::{FrameHeader, HEADER_LEN};
use crate::message::Envelope;
use crate::{ProtoError, MAX_FDS, MAX_PAYLOAD, PROTOCOL_VERSION};

/// How long a peer may stall in the middle of a frame before the connection is given up.
pub const DEFAULT_STALL: Duration = Duration::from_secs(5);

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
    stall: Duration,
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
            stall: DEFAULT_STALL,
        }
    }

    /// Sets how long a peer may stall mid-frame.
    pub fn with_stall_timeout(mut self, stall: Duration) -> Conn {
        self.stall = stall;
        self
    }

    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Sends one frame, with `fds` attached.
    pub fn send<T: Serialize>(
        &self,
        id: u64,
        msg: &T,
        fds: &[BorrowedFd<'_>],
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
        let _guard = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        self.send_raw(&header, &payload, fds)
    }

    /// Writes bytes as they are, for tests that must send malformed frames.
    pub fn send_bytes(&self, bytes: &[u8]) -> Result<(), ProtoError> {
        let _guard = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        self.send_raw(bytes, &[], &[])
    }

    fn send_raw(&self, a: &[u8], b: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), ProtoError> {
        let total = a.len() + b.len();
        let mut sent = 0;
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
        while sent < total {
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
            match rustix::net::sendmsg(&self.stream, &iov, &mut control, SendFlags::NOSIGNAL) {
                Ok(n) => sent += n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(ProtoError::Io(e.into())),
            }
        }
        Ok(())
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
    /// the stall timeout. A frame of another protocol version is read whole and reported as
    /// [`ProtoError::Version`], so the caller can still answer it.
    pub fn recv<T: DeserializeOwned>(&self) -> Result<Received<T>, ProtoError> {
        let mut rx = self.rx.lock().unwrap_or_else(|p| p.into_inner());
        let mut timed = false;
        let result = self.recv_locked(&mut rx, &mut timed);
        if timed {
            // Best effort: an idle wait for the next frame must not time out.
            let _ = self.stream.set_read_timeout(None);
        }
        result
    }

    fn recv_locked<T: DeserializeOwned>(
        &self,
        rx: &mut Rx,
        timed: &mut bool,
    ) -> Result<Received<T>, ProtoError> {
        self.fill(rx, HEADER_LEN, timed)?;
        let header: [u8; HEADER_LEN] = rx.buf[rx.start..rx.start + HEADER_LEN]
            .try_into()
            .expect("header length");
        let h = FrameHeader::decode(&header)?;
        let len = h.len as usize;
        self.fill(rx, HEADER_LEN + len, timed)?;
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

    /// Reads until `rx` holds at least `want` unread bytes.
    fn fill(&self, rx: &mut Rx, want: usize, timed: &mut bool) -> Result<(), ProtoError> {
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
            if !*timed && rx.end > rx.start {
                // A frame has begun: the rest must not take forever.
                self.stream.set_read_timeout(Some(self.stall))?;
                *timed = true;
            }
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
                Err(rustix::io::Errno::AGAIN) => return Err(ProtoError::Stalled(self.stall)),
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
            Conn::new(b).with_stall_timeout(Duration::from_millis(200)),
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

    #[test]
    fn fds_announced_but_missing_are_an_error() {
        let (a, b) = pair();
        let payload = postcard::to_stdvec(&Envelope {
            id: 1,
            msg: Request::Ping,
        })
        .unwrap();
        let mut frame = FrameHeader::new(2, payload.len()).encode().to_vec();
        frame.extend_from_slice(&payload);
        a.send_bytes(&frame).unwrap();
        assert!(matches!(
            b.recv::<Request>(),
            Err(ProtoError::MissingFds { announced: 2, .. })
        ));
    }
}
