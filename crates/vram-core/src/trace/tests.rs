use std::io::Write;

use super::*;

/// `pickle.dumps(d, protocol=4)` of a snapshot with one device trace: a free whose alloc is unseen,
/// an alloc with frames, its free_requested, a segment_alloc and its free_completed.
const SNAPSHOT_HEX: &str = "8004954b010000000000007d94288c087365676d656e7473945d948c12616c6c6f6361746f725f73657474696e6773947d948c0d6465766963655f747261636573945d945d94287d94288c06616374696f6e948c0e667265655f636f6d706c65746564948c0461646472944d00108c0473697a65944b408c0673747265616d944b008c0774696d655f7573944b058c066672616d6573945d94757d942868098c05616c6c6f6394680b4d0020680c4b64680d4b07680e4b0a680f5d947d94288c0866696c656e616d65948c04782e7079948c046c696e65944b018c046e616d65948c0166947561757d942868098c0e667265655f72657175657374656494680b4d0020680c4b64680d4b07680e4b0b757d942868098c0d7365676d656e745f616c6c6f6394680b4b00680c4a00002000680d4b07680e4b09757d94286809680a680b4d0020680c4b64680d4b07680e4b0c756561752e";

/// `{"device_traces": [[collections.OrderedDict(action="alloc")]]}`: a class, so refused.
const WITH_CLASS_HEX: &str = "8004954d000000000000007d948c0d6465766963655f747261636573945d945d948c0b636f6c6c656374696f6e73948c0b4f726465726564446963749493942952948c06616374696f6e948c05616c6c6f6394736161732e";

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

fn ev(action: Action, addr: u64, size: u64, stream: u64, time_us: u64) -> Event {
    Event {
        action,
        addr,
        size,
        stream,
        time_us,
    }
}

#[test]
fn pairs_allocs_with_completed_frees_and_allocates_unseen_ones_first() {
    use Action::{Alloc, Free};
    for input in [unhex(SNAPSHOT_HEX), gzip(&unhex(SNAPSHOT_HEX))] {
        let t = parse_snapshot(&input).unwrap();
        assert_eq!(
            t.events,
            vec![
                ev(Alloc, 0x1000, 64, 0, 5),
                ev(Free, 0x1000, 64, 0, 5),
                ev(Alloc, 0x2000, 100, 7, 10),
                ev(Free, 0x2000, 100, 7, 12),
            ]
        );
        assert_eq!((t.before_history, t.skipped_frees), (1, 0));
        assert_eq!(t.wall_us(), 7);
        let w = t.window_only();
        assert_eq!(
            w.events,
            vec![ev(Alloc, 0x2000, 100, 7, 10), ev(Free, 0x2000, 100, 7, 12)]
        );
        assert_eq!((w.before_history, w.skipped_frees), (0, 1));
        assert_eq!(w.wall_us(), 2);
    }
}

/// A snapshot whose history begins with a free of an unseen block (0x1000) and whose `segments`
/// still hold, on device 0, a block no event names (0x4000, 1000 bytes requested, stream 3), a
/// free block, and a block the history allocated (0x6000); and one block on device 1.
const WITH_SEGMENTS_HEX: &str = "80049537020000000000007d94288c087365676d656e7473945d94287d94288c06646576696365944b008c0761646472657373944d00408c0a746f74616c5f73697a65944d00408c0673747265616d944b038c06626c6f636b73945d94287d94288c0473697a65944d00108c0e7265717565737465645f73697a65944de8038c057374617465948c106163746976655f616c6c6f6361746564948c066672616d6573945d94757d9428680b4d0010680d8c08696e61637469766594757d9428680b4d0020680c4d0020680d680e7565757d942868044b0168054d009068064d001068074b0068085d947d9428680b4d0010680c4b05680d680e756175658c12616c6c6f6361746f725f73657474696e6773947d948c0d6465766963655f747261636573945d94285d94287d94288c06616374696f6e948c0e667265655f636f6d706c65746564948c0461646472944d0010680b4b4068074b008c0774696d655f7573944b05680f5d94757d9428681d8c05616c6c6f6394681f4d0060680b4d002068074b0368204b06757d9428681d6823681f4d0020680b4b6468074b0768204b0a680f5d947d94288c0866696c656e616d65948c04782e7079948c046c696e65944b018c046e616d65948c0166947561757d9428681d8c0e667265655f72657175657374656494681f4d0020680b4b6468074b0768204b0b757d9428681d8c0d7365676d656e745f616c6c6f6394681f4b00680b4a0000200068074b0768204b09757d9428681d681e681f4d0020680b4b6468074b0768204b0c75655d9465752e";

#[test]
fn blocks_still_allocated_that_no_event_names_were_live_before_the_history() {
    use Action::{Alloc, Free};
    let t = parse_snapshot(&unhex(WITH_SEGMENTS_HEX)).unwrap();
    assert_eq!(
        t.events,
        vec![
            ev(Alloc, 0x1000, 64, 0, 5),
            ev(Alloc, 0x4000, 1000, 3, 5),
            ev(Free, 0x1000, 64, 0, 5),
            ev(Alloc, 0x6000, 0x2000, 3, 6),
            ev(Alloc, 0x2000, 100, 7, 10),
            ev(Free, 0x2000, 100, 7, 12),
        ]
    );
    assert_eq!(t.before_history, 2);
    assert_eq!(t.before_history_bytes(), 1064);
    let w = t.window_only();
    assert_eq!(w.events, t.events[3..]);
    assert_eq!((w.skipped_frees, w.before_history_bytes()), (1, 0));
}

#[test]
fn refuses_classes_and_calls() {
    let err = parse_snapshot(&unhex(WITH_CLASS_HEX)).unwrap_err();
    assert!(matches!(err, TraceError::Pickle(_)), "{err}");
    // Protocol 0: os.system("echo hi"), a GLOBAL then REDUCE.
    let call = b"cos\nsystem\n(S'echo hi'\ntR.";
    assert!(parse_snapshot(call).is_err());
}

/// Frames shared as a snapshot recorded with stacks shares them (one frame in two tracebacks,
/// one traceback in two events), an address of 2^40 bytes and a stream above 2^63:
/// `pickle.dumps(d, protocol=4)`, then the same with protocol 2.
const SHARED_FRAMES_HEX: [&str; 2] = [
    "80049543010000000000007d94288c087365676d656e7473945d948c0d6465766963655f747261636573945d945d94287d94288c06616374696f6e948c05616c6c6f63948c0461646472944d00208c0473697a65944b648c0673747265616d944b078c0774696d655f7573944b0a8c066672616d6573945d94287d94288c0866696c656e616d65948c04782e7079948c046c696e65944b018c046e616d65948c016694757d942868108c04792e70799468124b0268138c0167947565757d94286807680868094d0030680a8a06000000000001680b8a09050000000000008000680c4b0b680d5d94286815680f65757d942868078c0e667265655f636f6d706c657465649468094d0020680a4b64680b4b07680c4b0c680d680e757d94286807681b68094d0030680a8a06000000000001680b8a09050000000000008000680c4b0d680d5d94680f61756561752e",
    "80027d71002858080000007365676d656e747371015d7102580d0000006465766963655f74726163657371035d71045d7105287d7106285806000000616374696f6e71075805000000616c6c6f63710858040000006164647271094d0020580400000073697a65710a4b64580600000073747265616d710b4b07580700000074696d655f7573710c4b0a58060000006672616d6573710d5d710e287d710f28580800000066696c656e616d6571105804000000782e7079711158040000006c696e6571124b0158040000006e616d6571135801000000667114757d71152868105804000000792e7079711668124b02681358010000006771177565757d7118286807680868094d0030680a8a06000000000001680b8a09050000000000008000680c4b0b680d5d7119286815680f65757d711a286807580e000000667265655f636f6d706c65746564711b68094d0020680a4b64680b4b07680c4b0c680d680e757d711c286807681b68094d0030680a8a06000000000001680b8a09050000000000008000680c4b0d680d5d711d680f61756561752e",
];

#[test]
fn frames_shared_among_events_are_read_once_and_large_integers_whole() {
    use Action::{Alloc, Free};
    let stream = (1 << 63) + 5;
    for hex in SHARED_FRAMES_HEX {
        let t = parse_snapshot(&unhex(hex)).unwrap();
        assert_eq!(
            t.events,
            vec![
                ev(Alloc, 0x2000, 100, 7, 10),
                ev(Alloc, 0x3000, 1 << 40, stream, 11),
                ev(Free, 0x2000, 100, 7, 12),
                ev(Free, 0x3000, 1 << 40, stream, 13),
            ]
        );
    }
}

/// `pickle.dumps(d, protocol=0)` of an alloc of 64 bytes at 0x1000 and its free (no segments).
const PROTOCOL_0_HEX: &str = "286470300a566465766963655f7472616365730a70310a286c70320a286c70330a286470340a56616374696f6e0a70350a56616c6c6f630a70360a7356616464720a70370a49343039360a735673697a650a70380a4936340a735673747265616d0a70390a49300a735674696d655f75730a7031300a49310a736128647031310a67350a56667265655f636f6d706c657465640a7031320a7367370a49343039360a7367380a4936340a7367390a49300a736731300a49330a736161732e";

#[test]
fn a_protocol_0_snapshot_is_read() {
    use Action::{Alloc, Free};
    let t = parse_snapshot(&unhex(PROTOCOL_0_HEX)).unwrap();
    assert_eq!(
        t.events,
        vec![ev(Alloc, 0x1000, 64, 0, 1), ev(Free, 0x1000, 64, 0, 3)]
    );
}

/// A snapshot PyTorch 2.11 wrote on an H100 with its default history settings (stacks on:
/// 4,405 frame references to 78 shared frame dicts; `scripts/h200/stacks_snapshot.py`): 63
/// allocs, 21 of them freed.
#[test]
fn a_snapshot_pytorch_recorded_with_stacks_is_read() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../docs/results/2026-12-07-h100-snapshot-with-stacks.pickle"
    );
    let t = parse_snapshot(&std::fs::read(path).unwrap()).unwrap();
    let allocs = t
        .events
        .iter()
        .filter(|e| e.action == Action::Alloc)
        .count();
    assert_eq!((allocs, t.events.len() - allocs), (63, 21));
    assert_eq!((t.before_history, t.skipped_frees), (0, 0));
}

#[test]
fn cut_or_corrupted_pickles_are_errors_never_panics() {
    let whole = unhex(SHARED_FRAMES_HEX[0]);
    for len in 0..whole.len() {
        assert!(parse_snapshot(&whole[..len]).is_err(), "cut at {len}");
    }
    for i in 0..whole.len() {
        for byte in [0x00, 0x28, 0x2e, 0x61, 0x68, 0x75, 0x8a, 0x94, 0xff] {
            let mut b = whole.clone();
            b[i] = byte;
            let _ = parse_snapshot(&b);
        }
    }
}

#[test]
fn what_is_not_a_snapshot_says_where_it_differs() {
    // `pickle.dumps({"device_traces": [[{"action": 5}]]}, protocol=4)`
    let hex = concat!(
        "80049528000000000000007d948c0d6465766963655f747261636573945d945d947d948c06616374696f6e",
        "944b05736161732e"
    );
    let err = parse_snapshot(&unhex(hex)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "not a PyTorch memory snapshot: device_traces[0][0].action is an int, not a str"
    );
    // `pickle.dumps([1], protocol=4)`
    let err = parse_snapshot(&unhex("80049506000000000000005d944b01612e")).unwrap_err();
    assert!(
        err.to_string().contains("a list without `device_traces`"),
        "{err}"
    );
}

#[test]
fn a_torch_save_archive_is_told_apart_with_the_call_that_writes_a_snapshot() {
    let err = parse_snapshot(b"PK\x03\x04\x00\x00archive/data.pkl").unwrap_err();
    assert!(matches!(err, TraceError::Zip), "{err}");
    assert!(err.to_string().contains("_dump_snapshot"), "{err}");
}

#[test]
fn rejects_garbage_and_truncated_gzip() {
    assert!(parse_snapshot(b"not a pickle").is_err());
    let gz = gzip(&unhex(SNAPSHOT_HEX));
    assert!(parse_snapshot(&gz[..gz.len() / 2]).is_err());
}

/// A snapshot whose `segments` have another shape (a block's size a string, its state a number):
/// its events replay all the same, the unseen block included.
const ODD_SEGMENTS_HEX: &str = "800495e8000000000000007d94288c087365676d656e7473945d947d94288c06646576696365944b008c0761646472657373944d00408c06626c6f636b73945d947d94288c0473697a65948c03626967948c057374617465944b07756175618c0d6465766963655f747261636573945d945d94287d94288c06616374696f6e948c0e667265655f636f6d706c65746564948c0461646472944d001068094b408c0673747265616d944b008c0774696d655f7573944b05757d942868108c05616c6c6f639468124d002068094b6468134b0768144b0a757d94286810681168124d002068094b6468134b0768144b0c756561752e";

#[test]
fn segments_of_another_shape_do_not_stop_the_events() {
    let t = parse_snapshot(&unhex(ODD_SEGMENTS_HEX)).unwrap();
    assert_eq!(t.before_history, 1);
    assert_eq!(t.events.len(), 4);
    assert_eq!(t.before_history_bytes(), 64);
}

/// A snapshot whose history records device 1 alone (device 0's is empty): an alloc and its
/// free, and a block still allocated on device 1 that no event names (0x4000, 1000 bytes, stream
/// 3); device 0's `segments` hold a block too, which belongs to no trace.
const DEVICE_ONE_HEX: &str = "80049520010000000000007d94288c087365676d656e7473945d94287d94288c06646576696365944b008c0761646472657373944d00808c0673747265616d944b008c06626c6f636b73945d947d94288c0473697a65944d00108c0e7265717565737465645f73697a65944b0a8c057374617465948c106163746976655f616c6c6f6361746564947561757d942868044b0168054d004068064b0368075d947d9428680a4d0010680b4de803680c680d756175658c0d6465766963655f747261636573945d94285d945d94287d94288c06616374696f6e948c05616c6c6f63948c0461646472944d0020680a4b6468064b078c0774696d655f7573944b0a757d942868168c0e667265655f636f6d706c657465649468184d0020680a4b6468064b0768194b0c756565752e";

/// Device 0 allocates 50 bytes at 0x2000, device 1 100 bytes at the same address.
const TWO_DEVICES_HEX: &str = "80049584000000000000007d94288c087365676d656e7473945d948c0d6465766963655f747261636573945d94285d947d94288c06616374696f6e948c05616c6c6f63948c0461646472944d00208c0473697a65944b328c0673747265616d944b008c0774696d655f7573944b0375615d947d94286807680868094d0020680a4b64680b4b07680c4b0a756165752e";

/// Segments with blocks, but histories with no allocation or free (a `segment_alloc` only).
const NO_EVENTS_HEX: &str = "80049501010000000000007d94288c087365676d656e7473945d94287d94288c06646576696365944b008c0761646472657373944d00808c0673747265616d944b008c06626c6f636b73945d947d94288c0473697a65944d00108c0e7265717565737465645f73697a65944b0a8c057374617465948c106163746976655f616c6c6f6361746564947561757d942868044b0168054d004068064b0368075d947d9428680a4d0010680b4de803680c680d756175658c0d6465766963655f747261636573945d94285d945d947d94288c06616374696f6e948c0d7365676d656e745f616c6c6f63948c0461646472944b00680a4a0000200068064b008c0774696d655f7573944b01756165752e";

#[test]
fn the_trace_is_the_device_whose_history_allocates_whichever_its_index() {
    use Action::{Alloc, Free};
    let t = parse_snapshot(&unhex(DEVICE_ONE_HEX)).unwrap();
    assert_eq!(
        t.events,
        vec![
            ev(Alloc, 0x4000, 1000, 3, 10),
            ev(Alloc, 0x2000, 100, 7, 10),
            ev(Free, 0x2000, 100, 7, 12),
        ]
    );
    assert_eq!(t.before_history, 1);
    let devices = parse_devices(&unhex(DEVICE_ONE_HEX)).unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0].device, 1);
}

#[test]
fn each_device_that_allocates_is_a_trace_of_its_own() {
    let devices = parse_devices(&unhex(TWO_DEVICES_HEX)).unwrap();
    let sizes: Vec<(usize, Vec<u64>)> = devices
        .iter()
        .map(|d| (d.device, d.trace.events.iter().map(|e| e.size).collect()))
        .collect();
    assert_eq!(sizes, vec![(0, vec![50]), (1, vec![100])]);
    let err = parse_snapshot(&unhex(TWO_DEVICES_HEX)).unwrap_err();
    assert!(
        matches!(&err, TraceError::SeveralDevices { devices } if devices == &[0, 1]),
        "{err}"
    );
}

#[test]
fn a_history_without_allocations_is_an_error_not_an_empty_workload() {
    let err = parse_devices(&unhex(NO_EVENTS_HEX)).unwrap_err();
    assert!(matches!(err, TraceError::NoEvents { devices: 2 }), "{err}");
    assert!(err.to_string().contains("_record_memory_history"), "{err}");
}

#[test]
fn the_wall_time_spans_the_earliest_event_to_the_latest_in_any_order() {
    let t = Trace {
        events: vec![
            ev(Action::Alloc, 1, 8, 0, 50),
            ev(Action::Alloc, 2, 8, 0, 30),
            ev(Action::Free, 1, 8, 0, 90),
            ev(Action::Free, 2, 8, 0, 70),
        ],
        ..Trace::default()
    };
    assert_eq!(t.wall_us(), 60);
    assert_eq!(t.share_of_wall(6.0), Some(0.1));
    assert_eq!(Trace::default().share_of_wall(6.0), None);
}
