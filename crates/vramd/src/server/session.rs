//! One connection: who the peer is, what it asks, and cleaning up after it whatever way it ends.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use vram_core::broker::{TenantId, TenantRequest};
use vram_core::Bytes;
use vram_proto::{Conn, ErrorCode, ErrorReply, Hello, ProtoError, Reply, Request, Role, Welcome};

use super::slot::ReclaimSender;
use super::Daemon;

/// A registered tenant on this connection.
struct Registered {
    slot: usize,
    id: TenantId,
    name: String,
}

struct Session {
    daemon: Arc<Daemon>,
    conn_id: u64,
    conn: Arc<Conn>,
    pid: u32,
    uid: u32,
    tenant: Option<Registered>,
}

pub fn run(daemon: Arc<Daemon>, conn_id: u64, conn: Arc<Conn>) {
    let creds = match rustix::net::sockopt::socket_peercred(conn.stream()) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!("cannot read peer credentials: {e}");
            daemon.conns.lock().expect("conns").remove(&conn_id);
            return;
        }
    };
    let mut session = Session {
        daemon,
        conn_id,
        conn,
        pid: creds.pid.as_raw_nonzero().get() as u32,
        uid: creds.uid.as_raw(),
        tenant: None,
    };
    if session.daemon.uid_allowed(session.uid) {
        session.serve();
    } else {
        tracing::warn!(
            uid = session.uid,
            pid = session.pid,
            "connection refused: uid not allowed"
        );
        let message = format!(
            "uid {} is not allowed to use this vramd (add it to allowed_uids in the daemon's config)",
            session.uid
        );
        session.send_error(0, ErrorCode::PermissionDenied, message);
    }
    session.finish();
}

impl Session {
    fn serve(&mut self) {
        loop {
            let received = match self.conn.recv::<Request>() {
                Ok(r) => r,
                Err(ProtoError::Closed) => return,
                Err(e) => {
                    self.daemon.protocol_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pid = self.pid, "protocol error: {e}");
                    if e.is_recoverable() {
                        self.send_error(0, ErrorCode::Malformed, format!("malformed request: {e}"));
                        continue;
                    }
                    self.send_error(
                        0,
                        ErrorCode::Protocol,
                        format!("{e}; closing the connection"),
                    );
                    return;
                }
            };
            // A client sends no descriptors; any it did are closed here.
            drop(received.fds);
            if !self.handle(received.id, received.msg) {
                return;
            }
        }
    }

    /// Answers one request; `false` ends the session.
    fn handle(&mut self, id: u64, request: Request) -> bool {
        let reply = match request {
            Request::Hello(hello) => self.hello(hello),
            Request::Status => Ok(Reply::Status(Box::new(self.daemon.status()))),
            Request::Ping => Ok(Reply::Pong),
            Request::Grant { bytes } => return self.grant(id, bytes),
            Request::Return { grants } => self.registered().and_then(|(slot, t)| {
                let (bytes, held) = self.daemon.slots[slot].give_back(t, &grants)?;
                Ok(Reply::Returned { bytes, held })
            }),
            Request::Usage { in_use, cached } => self.registered().map(|(slot, t)| {
                self.daemon.slots[slot].report_usage(t, in_use, cached);
                Reply::Ack
            }),
            Request::ReclaimDone { ask, returned } => self.registered().map(|_| {
                let name = self.tenant.as_ref().map_or("", |t| t.name.as_str());
                tracing::info!(tenant = name, ask, %returned, "reclaim answered");
                Reply::Ack
            }),
        };
        let reply = reply.unwrap_or_else(Reply::Error);
        self.conn.send(id, &reply, &[]).is_ok()
    }

    fn registered(&self) -> Result<(usize, TenantId), ErrorReply> {
        self.tenant
            .as_ref()
            .map(|t| (t.slot, t.id))
            .ok_or_else(|| ErrorReply {
                code: ErrorCode::NotRegistered,
                reason: None,
                message: "this request needs a Hello as a tenant first".into(),
            })
    }

    fn hello(&mut self, hello: Hello) -> Result<Reply, ErrorReply> {
        if let Some(t) = &self.tenant {
            return Err(ErrorReply {
                code: ErrorCode::NotRegistered,
                reason: None,
                message: format!("this connection is already tenant `{}`", t.name),
            });
        }
        let Role::Tenant {
            name,
            class,
            guarantee,
            limit,
        } = hello.role
        else {
            return Ok(Reply::Ack);
        };
        let slot = hello.gpu.unwrap_or(0) as usize;
        let Some(s) = self.daemon.slots.get(slot) else {
            return Err(ErrorReply {
                code: ErrorCode::Admission,
                reason: None,
                message: format!(
                    "gpu {slot} does not exist; this daemon serves {} device(s), 0 to {}",
                    self.daemon.slots.len(),
                    self.daemon.slots.len() - 1
                ),
            });
        };
        let request = TenantRequest {
            name,
            class,
            guarantee,
            limit,
            pid: self.pid,
            uid: self.uid,
        };
        let (id, t) = s.connect(request, self.conn_id).inspect_err(|e| {
            tracing::warn!(pid = self.pid, "tenant refused at connect: {}", e.message);
        })?;
        tracing::info!(
            tenant = t.name, class = t.class, guarantee = %t.guarantee, limit = %t.limit,
            pid = self.pid, gpu = slot, client = hello.client, "tenant connected"
        );
        self.tenant = Some(Registered {
            slot,
            id,
            name: t.name.clone(),
        });
        Ok(Reply::Welcome(Welcome {
            tenant: id.0,
            name: t.name,
            class: t.class,
            priority: t.priority,
            guarantee: t.guarantee,
            limit: t.limit,
            device: s.desc(),
        }))
    }

    fn grant(&mut self, id: u64, bytes: Bytes) -> bool {
        let (slot, tenant) = match self.registered() {
            Ok(r) => r,
            Err(e) => return self.conn.send(id, &Reply::Error(e), &[]).is_ok(),
        };
        let timeout = self.daemon.reclaim_timeout;
        let asker = Asker(&self.daemon);
        match self.daemon.slots[slot].grant(tenant, bytes, timeout, &asker) {
            Ok((grant, size, fd)) => {
                use std::os::fd::AsFd;
                let reply = Reply::Granted { grant, size };
                // If the tenant is gone by now, the grant is taken back with everything else.
                self.conn.send(id, &reply, &[fd.as_fd()]).is_ok()
            }
            Err(e) => {
                let name = self.tenant.as_ref().map_or("", |t| t.name.as_str());
                tracing::warn!(
                    tenant = name,
                    reason = e.reason.as_deref().unwrap_or(""),
                    "refused: {}",
                    e.message
                );
                self.conn.send(id, &Reply::Error(e), &[]).is_ok()
            }
        }
    }

    fn send_error(&self, id: u64, code: ErrorCode, message: String) {
        let reply = Reply::Error(ErrorReply {
            code,
            reason: None,
            message,
        });
        let _ = self.conn.send(id, &reply, &[]);
    }

    fn finish(self) {
        self.daemon
            .conns
            .lock()
            .expect("conns")
            .remove(&self.conn_id);
        let Some(t) = self.tenant else { return };
        let started = Instant::now();
        if let Some((state, handles)) = self.daemon.slots[t.slot].disconnect(t.id) {
            tracing::info!(
                tenant = t.name, pid = self.pid, reclaimed = %state.held, handles,
                micros = started.elapsed().as_micros() as u64, "tenant gone; its memory is back"
            );
        }
    }
}

/// Sends reclaim requests to other tenants' connections.
struct Asker<'a>(&'a Daemon);

impl ReclaimSender for Asker<'_> {
    fn ask(&self, conn: u64, bytes: Bytes) {
        let Some(c) = self.0.conns.lock().expect("conns").get(&conn).cloned() else {
            return;
        };
        let ask = self.0.next_ask.fetch_add(1, Ordering::Relaxed);
        let deadline_ms = self.0.reclaim_timeout.as_millis() as u32;
        tracing::info!(ask, %bytes, "asking a tenant to give back idle memory");
        let _ = c.send(
            0,
            &Reply::Reclaim {
                ask,
                bytes,
                deadline_ms,
            },
            &[],
        );
    }
}
