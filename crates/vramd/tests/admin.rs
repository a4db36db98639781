//! The daemon's admin calls: tenants declared at run time reserve their guarantee (or are
//! refused with the numbers), keep it across a SIGHUP reload, are withdrawn with their
//! connections closed, and only `admin_uids` may make them.

mod common;

use common::Daemon;
use vram_client::{ClientError, Observer};
use vram_core::Bytes;
use vram_proto::{Declaration, ErrorCode};

fn declaration(name: &str, guarantee: Bytes) -> Declaration {
    Declaration {
        name: name.into(),
        gpu: 0,
        class: "high".into(),
        guarantee,
        limit: Some(Bytes::gib(7)),
        owners: vec![],
    }
}

fn code(e: ClientError) -> (ErrorCode, String) {
    match e {
        ClientError::Daemon(r) => (r.code, r.message),
        other => panic!("not a daemon refusal: {other}"),
    }
}

#[test]
fn runtime_declarations_reserve_survive_a_reload_and_withdraw_takes_their_memory_back() {
    let config = "capacity = \"8 GiB\"\npriority_reserve = \"0\"\n";
    let d = Daemon::start(config);
    let admin = Observer::connect(Some(&d.socket)).unwrap();
    assert!(admin.declare(&declaration("job", Bytes::gib(6))).unwrap());
    assert!(
        !admin.declare(&declaration("job", Bytes::gib(6))).unwrap(),
        "the same again"
    );
    assert_eq!(d.status().devices[0].reserved, Bytes::gib(6));

    let (c, message) = code(
        admin
            .declare(&declaration("late", Bytes::gib(3)))
            .unwrap_err(),
    );
    assert_eq!(c, ErrorCode::Admission);
    assert!(
        message.contains("3 GiB") && message.contains("capacity 8 GiB"),
        "{message}"
    );
    let mut elsewhere = declaration("x", Bytes::ZERO);
    elsewhere.gpu = 3;
    assert_eq!(
        code(admin.declare(&elsewhere).unwrap_err()).0,
        ErrorCode::Admission
    );

    // A reload of the configuration keeps the runtime declaration.
    d.reload(config);
    assert_eq!(
        admin.declarations().unwrap(),
        vec![declaration("job", Bytes::gib(6))]
    );
    assert_eq!(d.status().devices[0].reserved, Bytes::gib(6));

    // A process connects as the declared tenant and takes memory; withdraw closes it.
    let mut t = d.tenant("job", &[]);
    let took = t.cmd("take 1GiB");
    assert_eq!(took["taken"], Bytes::gib(1).get(), "{took}");
    let st = d.status();
    let job = st.tenants.iter().find(|t| t.name == "job").unwrap();
    assert_eq!((job.guarantee, job.class.as_str()), (Bytes::gib(6), "high"));
    let (released, connections) = admin.withdraw("job").unwrap();
    assert_eq!((released, connections), (Bytes::gib(1), 1));
    assert!(admin.declarations().unwrap().is_empty());
    assert!(d.log().contains("tenant withdrawn"));
    t.kill();
    d.wait_for_no_tenants();
    let dev = &d.status().devices[0];
    assert_eq!(
        (dev.held, dev.reserved),
        (Bytes::ZERO, Bytes::ZERO),
        "{dev:?}"
    );

    let (c, message) = code(admin.withdraw("job").unwrap_err());
    assert_eq!(c, ErrorCode::NotFound, "{message}");
}

#[test]
fn only_admin_uids_may_declare() {
    let d = Daemon::start("capacity = \"8 GiB\"\nadmin_uids = [4242]\n");
    let o = Observer::connect(Some(&d.socket)).unwrap();
    let (c, message) = code(o.declare(&declaration("job", Bytes::gib(1))).unwrap_err());
    assert_eq!(c, ErrorCode::PermissionDenied);
    assert!(message.contains("admin_uids [4242]"), "{message}");
    assert_eq!(
        code(o.declarations().unwrap_err()).0,
        ErrorCode::PermissionDenied
    );
    assert_eq!(d.status().devices[0].reserved, Bytes::ZERO);
}

/// A process connected under a name before the name is declared for other owners is
/// disconnected when the declaration comes: it never holds the declared guarantee or class.
#[test]
fn a_declaration_disconnects_a_tenant_of_its_name_that_it_does_not_admit() {
    let d = Daemon::start("capacity = \"8 GiB\"\npriority_reserve = \"0\"\n");
    let admin = Observer::connect(Some(&d.socket)).unwrap();
    let mut squatter = d.tenant("k8s-claim", &[]);
    let took = squatter.cmd("take 1GiB");
    assert_eq!(took["taken"], Bytes::gib(1).get(), "{took}");
    let me = rustix::process::getuid().as_raw();
    let mut decl = declaration("k8s-claim", Bytes::gib(4));
    decl.owners = vec![me.wrapping_add(1)];
    assert!(admin.declare(&decl).unwrap());
    d.wait_for_no_tenants();
    let dev = &d.status().devices[0];
    assert_eq!(
        (dev.held, dev.reserved),
        (Bytes::ZERO, Bytes::gib(4)),
        "{dev:?}"
    );
    assert!(d.log().contains("does not admit"), "{}", d.log());
    squatter.kill();
}

/// A runtime declaration the configuration came to name too (a reload after it) stays in force
/// while it lasts; withdrawn, the configuration's declaration takes its place at once, without
/// waiting for another reload.
#[test]
fn a_withdrawn_declaration_gives_way_to_the_configurations_of_its_name() {
    let config = "capacity = \"8 GiB\"\npriority_reserve = \"0\"\n";
    let d = Daemon::start(config);
    let admin = Observer::connect(Some(&d.socket)).unwrap();
    assert!(admin.declare(&declaration("both", Bytes::gib(2))).unwrap());
    let with_it = format!("{config}[tenants.both]\nguarantee = \"1 GiB\"\n");
    d.reload(&with_it);
    assert!(
        d.log().contains("takes its place when it is withdrawn"),
        "{}",
        d.log()
    );
    assert_eq!(d.status().devices[0].reserved, Bytes::gib(2));

    admin.withdraw("both").unwrap();
    assert_eq!(d.status().devices[0].reserved, Bytes::gib(1), "{}", d.log());
    assert!(d.log().contains("in force again"), "{}", d.log());
    let t = d.tenant("both", &[]);
    let st = d.status();
    let both = st.tenants.iter().find(|t| t.name == "both").unwrap();
    assert_eq!(both.guarantee, Bytes::gib(1), "{both:?}");
    drop(t);
}
