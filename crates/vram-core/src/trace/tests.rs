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

#[test]
fn pairs_allocs_with_completed_frees_and_skips_unseen_ones() {
    let want = vec![
        Event {
            action: Action::Alloc,
            addr: 8192,
            size: 100,
            stream: 7,
            time_us: 10,
        },
        Event {
            action: Action::Free,
            addr: 8192,
            size: 100,
            stream: 7,
            time_us: 12,
        },
    ];
    for input in [unhex(SNAPSHOT_HEX), gzip(&unhex(SNAPSHOT_HEX))] {
        let t = parse_snapshot(&input).unwrap();
        assert_eq!(t.events, want);
        assert_eq!(t.skipped_frees, 1);
        assert_eq!(t.wall_us(), 2);
    }
}

#[test]
fn refuses_classes_and_calls() {
    let err = parse_snapshot(&unhex(WITH_CLASS_HEX)).unwrap_err();
    assert!(matches!(err, TraceError::Pickle(_)), "{err}");
    // Protocol 0: os.system("echo hi"), a GLOBAL then REDUCE.
    let call = b"cos\nsystem\n(S'echo hi'\ntR.";
    assert!(parse_snapshot(call).is_err());
}

#[test]
fn rejects_garbage_and_truncated_gzip() {
    assert!(parse_snapshot(b"not a pickle").is_err());
    let gz = gzip(&unhex(SNAPSHOT_HEX));
    assert!(parse_snapshot(&gz[..gz.len() / 2]).is_err());
}
