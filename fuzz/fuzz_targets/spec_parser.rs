//! The policy spec parser on arbitrary input: it must return (a spec or an error), never panic, overflow
//! the stack or hang. Besides the raw bytes, an input can describe `A^n B^n` (n up to 65535), so nesting
//! thousands of levels deep (`quest(a=` × n, `)` × n) is within the fuzzer's reach at a small input size.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    check(text);
    // Repetition form: "<n>|<A>|<B>" → A repeated n times, then B repeated n times.
    let mut parts = text.splitn(3, '|');
    if let (Some(n), Some(a), Some(b)) = (parts.next(), parts.next(), parts.next()) {
        if let Ok(n) = n.trim().parse::<u16>() {
            let spec = a.repeat(n as usize) + &b.repeat(n as usize);
            check(&spec);
        }
    }
});

fn check(spec: &str) {
    match kvsparse::policy::Policy::parse(spec) {
        Ok(_) => {}
        Err(e) => assert!(!e.message.is_empty(), "an error without a message for {spec:?}"),
    }
}
