//! The plugin's API-server side against the in-process stand-in (`vramd_k8s::stand_in`): the
//! node's ResourceSlice is created, left alone while the daemon's devices stay the same, replaced
//! with the pool's generation one higher when they change, and a stale slice of the node's is
//! deleted.

use vram_core::Bytes;
use vram_proto::{BackendKind, DaemonInfo, DeviceStatus, StatusReport};
use vramd_k8s::plugin::Identity;
use vramd_k8s::slices::{slice_name, Published, Publisher, RequestPolicy};
use vramd_k8s::stand_in::StandIn;

fn device(index: u32, capacity: Bytes) -> DeviceStatus {
    DeviceStatus {
        index,
        uuid: format!("HOST-{index}"),
        name: "host memory".into(),
        backend: BackendKind::Host,
        capacity,
        granularity: Bytes::mib(2),
        held: Bytes::ZERO,
        pooled: Bytes::ZERO,
        reserved: Bytes::ZERO,
        free: capacity,
        device_used: Bytes::ZERO,
        pool: Default::default(),
        driver_used: None,
        outside_use: Bytes::ZERO,
        unattributed: Bytes::ZERO,
        outside_processes: Vec::new(),
        deficit: Bytes::ZERO,
        at_risk: Vec::new(),
        kept: Bytes::ZERO,
        kept_offline: Vec::new(),
    }
}

fn status(devices: Vec<DeviceStatus>) -> StatusReport {
    StatusReport {
        daemon: DaemonInfo {
            pid: 1,
            version: "0.1.0".into(),
            uptime_seconds: 1.0,
            socket: "/run/vramd/vramd.sock".into(),
            protocol_errors: 0,
            connections: 0,
            log_lines_dropped: 0,
            connections_refused: 0,
            tenants_left_out: 0,
        },
        devices,
        tenants: Vec::new(),
        shared: Default::default(),
    }
}

#[test]
fn the_node_slice_is_created_kept_and_replaced_as_the_daemon_changes() {
    let api = StandIn::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let config = kube::Config::new(api.url().parse().unwrap());
        let client = kube::Client::try_from(config).unwrap();
        let id = Identity {
            driver: "vramd.io".into(),
            node: "node-a".into(),
        };
        let policy = RequestPolicy {
            default: Bytes::gib(1),
            step: Bytes::mib(64),
        };
        let one = status(vec![device(0, Bytes::gib(16))]);
        let mut node_a = Publisher::default();
        assert_eq!(
            node_a.publish(&client, &id, &one, policy).await.unwrap(),
            Published::Created
        );
        assert_eq!(
            node_a.publish(&client, &id, &one, policy).await.unwrap(),
            Published::Unchanged
        );
        let s = &api.slices()[0];
        assert_eq!(s.metadata.name.as_deref(), Some(slice_name(&id).as_str()));
        assert_eq!(s.spec.pool.generation, 1);
        let d = &s.spec.devices.as_ref().unwrap()[0];
        let memory = &d.capacity.as_ref().unwrap()["memory"];
        assert_eq!(memory.value.0, "16Gi");
        let range = memory
            .request_policy
            .as_ref()
            .unwrap()
            .valid_range
            .as_ref()
            .unwrap();
        assert_eq!(range.step.as_ref().unwrap().0, "64Mi");

        // A second GPU: the slice is replaced, the pool's generation goes up.
        let two = status(vec![device(0, Bytes::gib(16)), device(1, Bytes::gib(8))]);
        assert_eq!(
            node_a.publish(&client, &id, &two, policy).await.unwrap(),
            Published::Updated
        );
        let s = &api.slices()[0];
        assert_eq!(s.spec.pool.generation, 2);
        assert_eq!(s.spec.devices.as_ref().unwrap().len(), 2);

        // Another node's slice stays; a stale one of this node's goes.
        let other = Identity {
            driver: "vramd.io".into(),
            node: "node-b".into(),
        };
        Publisher::default()
            .publish(&client, &other, &one, policy)
            .await
            .unwrap();
        let mut stale = api
            .slices()
            .into_iter()
            .find(|s| s.spec.node_name.as_deref() == Some("node-a"))
            .unwrap();
        stale.metadata.name = Some("node-a-old".into());
        stale.metadata.resource_version = None;
        kube::Api::<k8s_openapi::api::resource::v1::ResourceSlice>::all(client.clone())
            .create(&Default::default(), &stale)
            .await
            .unwrap();
        assert_eq!(
            node_a.publish(&client, &id, &two, policy).await.unwrap(),
            Published::Unchanged
        );
        let mut names: Vec<String> = api
            .slices()
            .into_iter()
            .filter_map(|s| s.metadata.name)
            .collect();
        names.sort();
        assert_eq!(names, vec![slice_name(&id), slice_name(&other)]);

        // An API server that keeps less than it was sent (no consumable capacity): the slice is
        // written once, and what the server made of it is then no change to write again.
        api.drop_consumable_capacity();
        let mut publisher = Publisher::default();
        let three = status(vec![device(0, Bytes::gib(16)), device(1, Bytes::gib(12))]);
        for expected in [
            Published::Updated,
            Published::Unchanged,
            Published::Unchanged,
        ] {
            assert_eq!(
                publisher
                    .publish(&client, &id, &three, policy)
                    .await
                    .unwrap(),
                expected
            );
        }
        let s = api
            .slices()
            .into_iter()
            .find(|s| s.metadata.name.as_deref() == Some(slice_name(&id).as_str()))
            .unwrap();
        assert_eq!(s.spec.pool.generation, 3);
        assert_eq!(
            s.spec.devices.as_ref().unwrap()[0].allow_multiple_allocations,
            None
        );
        // A change of the devices is still written.
        assert_eq!(
            publisher.publish(&client, &id, &two, policy).await.unwrap(),
            Published::Updated
        );
    });
    let reqs = api.requests();
    assert!(
        reqs.iter().any(
            |r| r.starts_with("GET /apis/resource.k8s.io/v1/resourceslices?")
                && r.contains("fieldSelector")
        ),
        "{reqs:?}"
    );
    assert!(reqs.iter().any(|r| r.starts_with("PUT ")), "{reqs:?}");
    assert!(reqs.iter().any(|r| r.starts_with("DELETE ")), "{reqs:?}");
}
