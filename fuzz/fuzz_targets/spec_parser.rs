//! The policy spec parser on arbitrary input: it must return (a spec or an error), never panic, overflow
//! the stack or hang. Besides the raw bytes, an input can describe `A^n B^n` (at most 16 KiB in all), which
//! is parsed on a thread with a 128 KiB stack: nesting a couple of thousand levels deep (`quest(a=` × n,
//! `)` × n) is then a 20-byte input, and a parser that recursed per level would overflow that stack.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    check(text);
    // Repetition form: "<n>|<A>|<B>" → A repeated n times, then B repeated n times.
    let mut parts = text.splitn(3, '|');
    if let (Some(n), Some(a), Some(b)) = (parts.next(), parts.next(), parts.next()) {
        if let Ok(n) = n.trim().parse::<u16>() {
            let n = (n as usize).min((16 << 10) / (a.len() + b.len()).max(1));
            let spec = a.repeat(n) + &b.repeat(n);
            let small_stack = std::thread::Builder::new().stack_size(128 << 10).spawn(move || check(&spec)).expect("spawn");
            small_stack.join().expect("the parser panicked");
        }
    }
});

fn check(spec: &str) {
    match kvsparse::policy::Policy::parse(spec) {
        Ok(_) => {}
        Err(e) => assert!(!e.message.is_empty(), "an error without a message for {spec:?}"),
    }
}
