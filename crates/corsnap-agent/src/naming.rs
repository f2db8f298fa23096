//! Pure functions that turn metadata strings into display names. Kept apart
//! (and public) so they can be fuzzed with hostile input: metadata is the
//! program's, and names can be odd, huge, or not valid UTF-16.

/// Longest name kept, in characters; longer ones are cut with a marker.
pub const MAX_NAME_CHARS: usize = 2048;

/// Decodes a UTF-16 name from metadata: stops at a NUL, replaces unpaired
/// surrogates, and caps the length.
pub fn name_from_utf16(units: &[u16]) -> String {
    let end = units.iter().position(|&c| c == 0).unwrap_or(units.len());
    let mut name: String = char::decode_utf16(units[..end].iter().copied())
        .map(|c| c.unwrap_or(char::REPLACEMENT_CHARACTER))
        .take(MAX_NAME_CHARS + 1)
        .collect();
    if name.chars().count() > MAX_NAME_CHARS {
        name = name.chars().take(MAX_NAME_CHARS).collect();
        name.push('…');
    }
    name
}

/// `Ledger`1` -> `Ledger`.
pub fn strip_arity(name: &str) -> &str {
    match name.rfind('`') {
        Some(i) if name[i + 1..].bytes().all(|b| b.is_ascii_digit()) && i + 1 < name.len() => &name[..i],
        _ => name,
    }
}

pub fn push_generic_params(out: &mut String, params: &[String]) {
    if params.is_empty() {
        return;
    }
    out.push('<');
    for (i, p) in params.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(p);
    }
    out.push('>');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_decode_leniently_and_are_capped() {
        assert_eq!(name_from_utf16(&[0x41, 0xD800, 0x42, 0, 0x43]), "A\u{FFFD}B");
        let long = vec![0x61u16; 10_000];
        assert_eq!(name_from_utf16(&long).chars().count(), MAX_NAME_CHARS + 1);
    }

    #[test]
    fn arity_suffix_is_stripped_only_when_numeric() {
        assert_eq!(strip_arity("Ledger`1"), "Ledger");
        assert_eq!(strip_arity("Dictionary`2"), "Dictionary");
        assert_eq!(strip_arity("Odd`"), "Odd`");
        assert_eq!(strip_arity("Plain"), "Plain");
        assert_eq!(strip_arity("We`ird"), "We`ird");
    }

    #[test]
    fn generic_params_render_csharp_style() {
        let mut s = "Settle".to_string();
        push_generic_params(&mut s, &["TKey".into(), "TValue".into()]);
        assert_eq!(s, "Settle<TKey, TValue>");
        let mut s = "Plain".to_string();
        push_generic_params(&mut s, &[]);
        assert_eq!(s, "Plain");
    }
}
