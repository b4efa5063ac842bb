use super::*;

fn lines(pairs: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_string(), v.as_bytes().to_vec()))
        .collect()
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[test]
fn a_request_is_named_by_its_request_id_and_trace_id() {
    let t = Trace::of_request(&lines(&[("X-Request-Id", "r-1"), ("traceparent", TRACEPARENT)]));
    assert_eq!(t.request_id.as_deref(), Some("r-1"));
    assert_eq!(t.trace_id.as_deref(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
}

#[test]
fn what_breaks_the_rules_is_dropped_not_refused() {
    let long = "r".repeat(MAX_REQUEST_ID + 1);
    for bad in ["", "a b", "\u{e9}", long.as_str()] {
        let t = Trace::of_request(&lines(&[("x-request-id", bad)]));
        assert_eq!(t.request_id, None, "{bad:?}");
    }
    for bad in [
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736",
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
    ] {
        let t = Trace::of_request(&lines(&[("traceparent", bad)]));
        assert_eq!(t.trace_id, None, "{bad:?}");
    }
    // Two lines could name two requests.
    let t = Trace::of_request(&lines(&[("x-request-id", "a"), ("x-request-id", "b")]));
    assert!(t.is_empty());
}

#[test]
fn a_later_traceparent_version_keeps_its_trace_id() {
    let v = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra";
    let t = Trace::of_request(&lines(&[("traceparent", v)]));
    assert_eq!(t.trace_id.as_deref(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));
}

#[test]
fn a_header_names_each_call_in_order_and_the_store_reads_it_back() {
    let a = Trace {
        request_id: Some("r-1".into()),
        trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".into()),
    };
    let b = Trace {
        request_id: None,
        trace_id: Some("00f067aa0ba902b700f067aa0ba902b7".into()),
    };
    let calls = [a.clone(), Trace::NONE, b.clone()];
    let header = Trace::header(&calls).unwrap();
    assert_eq!(
        header,
        "r-1 4bf92f3577b34da6a3ce929d0e0e4736,- -,- 00f067aa0ba902b700f067aa0ba902b7"
    );
    assert_eq!(Trace::parse_header(Some(header.as_bytes()), 3), calls);
    // Nothing to name: no header.
    assert_eq!(Trace::header(&[Trace::NONE, Trace::NONE]), None);
}

#[test]
fn the_store_drops_labels_that_break_the_rules_and_keeps_the_call() {
    let parsed = Trace::parse_header(Some(b"a\x01b 4BF92F3577B34DA6A3CE929D0E0E4736, r-2 -"), 2);
    assert_eq!(parsed[0], Trace::NONE);
    assert_eq!(parsed[1].request_id.as_deref(), Some("r-2"));
    // A count that does not match the calls names none of them.
    assert_eq!(Trace::parse_header(Some(b"r-1 -,r-2 -"), 3), vec![Trace::NONE; 3]);
    assert_eq!(Trace::parse_header(None, 2), vec![Trace::NONE; 2]);
    // A request id with a comma would split its entry: dropped at the source.
    let t = Trace::of_request(&lines(&[("x-request-id", "a,b")]));
    assert_eq!(t.request_id, None);
}
