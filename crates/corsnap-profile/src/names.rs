//! Readable names for the methods the C# compiler made up.
//!
//! Roslyn and Mono's compiler turn lambdas, local functions, closures, async
//! methods and iterators into methods and nested types with names no one
//! wrote (`Shop.Orders+<>c__DisplayClass1_0<T>.<Build>b__5`,
//! `Shop.Orders+<HandleAsync>d__4.MoveNext`). [`readable_name`] turns such a
//! name back into the method the user wrote, with what the compiler made of
//! it as a last part or marker:
//!
//! | raw (as the runtime names it) | readable |
//! |---|---|
//! | `T.<M>b__1_2`, `T+<>c.<M>b__1_2`, `T+<>c__DisplayClass1_0.<M>b__2` (lambdas) | `T.M.lambda#2` |
//! | `T.<M>g__Local\|1_0`, `T+<>c__DisplayClass1_0.<M>g__Local\|0` (local functions) | `T.M.Local` |
//! | `T+<M>d__4.MoveNext` (async method, iterator, async iterator) | `T.M [async]`, `T.M [iterator]`, `T.M [async iterator]`, or `T.M [state machine]` when the stack does not tell |
//! | `T+<M>d__4.System.IDisposable.Dispose` (another member of a state machine) | `T.M [iterator: Dispose]` |
//! | `T+<<M>b__0_1>d.MoveNext` (an async lambda) | `T.M.lambda#1 [async]` |
//! | `Program.<Main>$` (top-level statements) | `Program.Main` |
//! | Mono: `T+<M>c__AnonStorey0.<>m__0`, `T.<M>m__0` | `T.M.lambda#0` |
//! | Mono: `T+<M>c__Iterator0.MoveNext`, `T+<M>c__async0.MoveNext` | `T.M [iterator]`, `T.M [async]` |
//!
//! Generic parameters that a closure or state machine type carries are the
//! method's (`T+<>c__DisplayClass1_0<U>.<M>b__5` is `T.M<U>.lambda#5`). Real
//! nested types keep their `+`. A name that is not compiler-generated, or
//! that does not follow these conventions all the way, is returned as it is.
//!
//! Roslyn gives async methods, iterators and async iterators the same kind
//! of name (`<M>d__N`). The agent reads which one a `MoveNext` is from the
//! interfaces its type declares and says so
//! ([`corsnap_wire::Message::StateMachine`]). Where it did not (a recording
//! made before it did, metadata it could not read), who calls the
//! `MoveNext` tells ([`state_machine_from_callers`]): the runtime's async
//! machinery (or the method itself, on its first run) for an async method,
//! anyone else for an iterator.

use std::borrow::Cow;

pub use corsnap_wire::StateMachine;

fn marker_of(kind: StateMachine) -> &'static str {
    match kind {
        StateMachine::Async => "async",
        StateMachine::Iterator => "iterator",
        StateMachine::AsyncIterator => "async iterator",
    }
}

/// The readable form of a managed method's name, as the agent renders it
/// (`Namespace.Type<T>+Nested.Method<U>`). `seen_as` is what the stack showed
/// a Roslyn state machine's `MoveNext` to be ([`state_machine_from_callers`]);
/// it is ignored for every other name.
pub fn readable_name(raw: &str, seen_as: Option<StateMachine>) -> Cow<'_, str> {
    match render(raw, seen_as, 0) {
        Some(name) => Cow::Owned(name),
        None => Cow::Borrowed(raw),
    }
}

/// Whether `raw` is the `MoveNext` of a Roslyn state machine (`<M>d__N`,
/// `<<M>b__0_1>d`), the one name whose readable form depends on the stack.
pub fn is_roslyn_move_next(raw: &str) -> bool {
    roslyn_state_machine(raw).is_some()
}

/// What the stack says a Roslyn state machine's `MoveNext` is. `callers`
/// are the frames below it, nearest first: `Some(raw name)` for a managed
/// frame, `None` for anything else (native code, unknown code, a stack's
/// end), which says nothing.
///
/// Called by the runtime's async machinery (`AsyncMethodBuilderCore.Start`,
/// a state machine box, `ExecutionContext.RunInternal`), or by the method
/// that started it, it is an async method; if the first frame below that
/// machinery is the state machine's own `MoveNextAsync`, an async iterator.
/// Called by other managed code (a `foreach`, LINQ), an iterator; that
/// includes another state machine's `MoveNext` (a `foreach` in an async
/// method). An async method's `MoveNext` is misread as an iterator's when
/// the JIT inlined both the method and `AsyncMethodBuilderCore.Start` (a
/// method with a `try`/`finally`, which .NET 10 inlines) into its caller;
/// the agent's word from the metadata comes first for that reason.
pub fn state_machine_from_callers<'a>(
    raw: &str,
    callers: impl IntoIterator<Item = Option<&'a str>>,
) -> Option<StateMachine> {
    let (machine_type, kickoff) = roslyn_state_machine(raw)?;
    let mut callers = callers.into_iter();
    let first = callers.next()??;
    let starts_method = |name: &str, method: &str| {
        name.strip_prefix(method).is_some_and(|rest| rest.is_empty() || rest.starts_with('<'))
    };
    if starts_method(first, &kickoff) {
        return Some(StateMachine::Async);
    }
    if is_async_machinery(first) {
        for caller in callers.take(16) {
            let Some(caller) = caller else { break };
            if is_async_machinery(caller) {
                continue;
            }
            let own_member = caller.strip_prefix(machine_type).and_then(|rest| rest.strip_prefix('.'));
            if own_member.is_some_and(|member| member.ends_with("MoveNextAsync")) {
                return Some(StateMachine::AsyncIterator);
            }
            break;
        }
        return Some(StateMachine::Async);
    }
    if first.starts_with('[') {
        return None;
    }
    Some(StateMachine::Iterator)
}

/// The runtime's code between an async method's resumption and its
/// `MoveNext`.
fn is_async_machinery(name: &str) -> bool {
    (name.starts_with("System.Runtime.CompilerServices.") && name.contains("Async"))
        || name.starts_with("System.Threading.ExecutionContext.")
}

/// For a Roslyn state machine's `MoveNext`: the state machine type's raw
/// name and the raw name of the method it was made from (without generic
/// parameters).
fn roslyn_state_machine(raw: &str) -> Option<(&str, String)> {
    let machine_type = raw.strip_suffix(".MoveNext")?;
    let segments = split(machine_type)?;
    let last = segments.last()?;
    if last.separator != Some('+') {
        return None;
    }
    let (core, _generics) = split_generics(last.text)?;
    let (inner, rest) = bracketed(core)?;
    let is_machine = match rest.strip_prefix("d") {
        Some("") => inner.starts_with('<'),
        Some(number) => number.strip_prefix("__").is_some_and(is_number),
        None => false,
    };
    if !is_machine || inner.is_empty() {
        return None;
    }
    let container = &machine_type[..last.start - 1];
    Some((machine_type, format!("{container}.{inner}")))
}

/// One part of a name between `.` and `+` separators outside `<…>`.
#[derive(Debug, Clone, Copy)]
struct Segment<'a> {
    /// The separator before it (`None` for the first).
    separator: Option<char>,
    text: &'a str,
    /// Byte offset of `text` in the whole name.
    start: usize,
}

/// Splits at `.` and `+` outside angle brackets; `None` if the brackets do
/// not balance. `Type..ctor` gives `Type` and `.ctor`.
fn split(name: &str) -> Option<Vec<Segment<'_>>> {
    let mut segments = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    let mut separator = None;
    for (i, c) in name.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => depth = depth.checked_sub(1)?,
            '.' | '+' if depth == 0 => {
                // A method named `.ctor`: the dot is part of the name.
                if c == '.' && i == start && (separator.is_some() || i == 0) {
                    continue;
                }
                segments.push(Segment { separator, text: &name[start..i], start });
                separator = Some(c);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return None;
    }
    segments.push(Segment { separator, text: &name[start..], start });
    Some(segments)
}

/// `<>c__DisplayClass1_0<T, U>` → (`<>c__DisplayClass1_0`, `<T, U>`); the
/// generic list is empty when there is none. `None` if the brackets do not
/// balance.
fn split_generics(text: &str) -> Option<(&str, &str)> {
    if !text.ends_with('>') {
        return Some((text, ""));
    }
    let mut depth = 0usize;
    for (i, c) in text.char_indices().rev() {
        match c {
            '>' => depth += 1,
            '<' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some((&text[..i], &text[i..]));
                }
            }
            _ => {}
        }
    }
    None
}

/// `<inner>rest` → (`inner`, `rest`), the brackets matched.
fn bracketed(text: &str) -> Option<(&str, &str)> {
    if !text.starts_with('<') {
        return None;
    }
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            '<' => depth += 1,
            '>' => {
                depth -= 1;
                if depth == 0 {
                    return Some((&text[1..i], &text[i + 1..]));
                }
            }
            _ => {}
        }
    }
    None
}

fn is_number(text: &str) -> bool {
    !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit())
}

/// `1_2` or `2` → `2` (the last ordinal, the one that tells siblings apart).
fn last_ordinal(text: &str) -> Option<&str> {
    let (first, last) = match text.split_once('_') {
        Some((method, ordinal)) => (method, ordinal),
        None => ("0", text),
    };
    (is_number(first) && is_number(last)).then_some(last)
}

/// What one bracketed compiler-generated segment stands for.
#[derive(Debug)]
enum Generated {
    /// A closure class (`<>c__DisplayClass1_0`, `<>c`, `<>c__3`) that does
    /// not name its method; a Mono closure (`<M>c__AnonStorey0`) does.
    Closure { method: Option<String> },
    /// A state machine type for `method`; `kind` when its name says it.
    StateMachine { method: String, kind: Option<StateMachine> },
    /// A lambda (`lambda#2`) or local function (`Local`) of `method` (the
    /// enclosing closure's, for Mono's `<>m__0`).
    Function { method: Option<String>, part: String },
    /// `<Main>$`: the method of top-level statements.
    Method(String),
}

/// Reads one segment made by the compiler, without its generic list.
fn generated(core: &str, depth: usize) -> Option<Generated> {
    let (inner, rest) = bracketed(core)?;
    // Edit-and-continue adds a generation: `<M>b__0_1#2`.
    let rest = match rest.rsplit_once('#') {
        Some((head, generation)) if is_number(generation) => head,
        _ => rest,
    };
    if inner.is_empty() {
        return match rest {
            "c" => Some(Generated::Closure { method: None }),
            _ if rest.strip_prefix("c__").is_some_and(is_number) => Some(Generated::Closure { method: None }),
            _ if rest.strip_prefix("c__DisplayClass").is_some_and(|n| last_ordinal(n).is_some()) => {
                Some(Generated::Closure { method: None })
            }
            _ => {
                let ordinal = rest.strip_prefix("m__").filter(|n| is_number(n))?;
                Some(Generated::Function { method: None, part: format!("lambda#{ordinal}") })
            }
        };
    }
    // The method's own name may be generated too (`<<Main>$>g__Local|0_0`,
    // `<<Main>b__0_1>d`).
    let method = if inner.starts_with('<') { render_method(inner, depth + 1)? } else { inner.to_string() };
    if let Some(ordinals) = rest.strip_prefix("b__") {
        let ordinal = last_ordinal(ordinals)?;
        return Some(Generated::Function { method: Some(method), part: format!("lambda#{ordinal}") });
    }
    if let Some(local) = rest.strip_prefix("g__") {
        let (name, ordinals) = local.rsplit_once('|')?;
        last_ordinal(ordinals)?;
        if name.is_empty() {
            return None;
        }
        return Some(Generated::Function { method: Some(method), part: name.to_string() });
    }
    if rest == "d" && inner.starts_with('<') {
        return Some(Generated::StateMachine { method, kind: None });
    }
    if rest.strip_prefix("d__").is_some_and(is_number) {
        return Some(Generated::StateMachine { method, kind: None });
    }
    if rest == "$" && inner == "Main" {
        return Some(Generated::Method(method));
    }
    let mono = |prefix: &str| rest.strip_prefix(prefix).is_some_and(is_number);
    if mono("c__AnonStorey") {
        return Some(Generated::Closure { method: Some(method) });
    }
    if mono("c__Iterator") {
        return Some(Generated::StateMachine { method, kind: Some(StateMachine::Iterator) });
    }
    if mono("c__async") {
        return Some(Generated::StateMachine { method, kind: Some(StateMachine::Async) });
    }
    if let Some(ordinal) = rest.strip_prefix("m__").filter(|n| is_number(n)) {
        return Some(Generated::Function { method: Some(method), part: format!("lambda#{ordinal}") });
    }
    None
}

/// A generated method name on its own (`<Main>b__0_1` → `Main.lambda#1`),
/// for names nested in other generated names.
fn render_method(name: &str, depth: usize) -> Option<String> {
    if depth > 4 {
        return None;
    }
    let (core, generics) = split_generics(name)?;
    match generated(core, depth)? {
        Generated::Function { method: Some(method), part } => Some(format!("{method}.{part}{generics}")),
        Generated::Method(method) => Some(format!("{method}{generics}")),
        _ => None,
    }
}

fn render(raw: &str, seen_as: Option<StateMachine>, depth: usize) -> Option<String> {
    // Most names have nothing generated: no segment starts with `<`.
    if !raw.contains('<') {
        return None;
    }
    let segments = split(raw)?;
    let first = segments.iter().position(|s| s.text.starts_with('<'))?;
    let prefix = match first {
        0 => "",
        _ => &raw[..segments[first].start - 1],
    };

    // The method the user wrote, its path of lambdas and local functions,
    // and the state machine it became.
    let mut method: Option<String> = None;
    let mut method_generics = "";
    let mut parts: Vec<String> = Vec::new();
    let mut machine: Option<(Option<StateMachine>, &str)> = None;
    let last = segments.len() - 1;
    for (i, segment) in segments.iter().enumerate().skip(first) {
        if machine.is_some() {
            // Everything after a state machine type is its member, which
            // may itself be dotted (`System.IDisposable.Dispose`).
            machine = machine.map(|(kind, _)| (kind, &raw[segment.start..]));
            break;
        }
        let (core, generics) = split_generics(segment.text)?;
        match generated(core, depth) {
            Some(Generated::Closure { method: named }) if i < last => {
                if let Some(name) = named {
                    note_method(&mut method, &mut parts, name);
                }
                if method_generics.is_empty() {
                    method_generics = generics;
                }
            }
            Some(Generated::StateMachine { method: name, kind }) if i < last => {
                note_method(&mut method, &mut parts, name);
                if method_generics.is_empty() {
                    method_generics = generics;
                }
                machine = Some((kind, ""));
            }
            Some(Generated::Function { method: name, part }) if i == last => {
                if let Some(name) = name {
                    note_method(&mut method, &mut parts, name);
                }
                parts.push(format!("{part}{generics}"));
            }
            Some(Generated::Method(name)) if i == last => {
                note_method(&mut method, &mut parts, name);
                if method_generics.is_empty() {
                    method_generics = generics;
                }
            }
            _ => return None,
        }
    }
    let method = method?;

    let mut out = String::with_capacity(raw.len());
    if !prefix.is_empty() {
        out.push_str(prefix);
        out.push('.');
    }
    out.push_str(&method);
    out.push_str(method_generics);
    for part in &parts {
        out.push('.');
        out.push_str(part);
    }
    if let Some((kind, member)) = machine {
        match member {
            "" => return None,
            "MoveNext" => {
                let marker = kind.or(seen_as).map_or("state machine", marker_of);
                out.push_str(&format!(" [{marker}]"));
            }
            member => {
                let kind = kind.or_else(|| member_says(member));
                let marker = kind.map_or("state machine", marker_of);
                let short = split(member).and_then(|s| s.last().map(|s| s.text)).unwrap_or(member);
                out.push_str(&format!(" [{marker}: {short}]"));
            }
        }
    }
    Some(out)
}

/// The method a generated name belongs to: the first one named, or a
/// further part if another is named below it.
fn note_method(method: &mut Option<String>, parts: &mut Vec<String>, name: String) {
    match method {
        Some(known) if *known == name => {}
        Some(_) => parts.push(name),
        None => *method = Some(name),
    }
}

/// What a state machine's member other than `MoveNext` says it is.
fn member_says(member: &str) -> Option<StateMachine> {
    if ["IAsyncEnumera", "IAsyncDisposable", "MoveNextAsync", "DisposeAsync"].iter().any(|s| member.contains(s)) {
        Some(StateMachine::AsyncIterator)
    } else if ["IEnumerator", "IEnumerable", "IDisposable"].iter().any(|s| member.contains(s)) {
        Some(StateMachine::Iterator)
    } else if member.contains("IAsyncStateMachine") || member == "SetStateMachine" {
        Some(StateMachine::Async)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use StateMachine::*;

    /// (raw, what the stack said, readable).
    const GOLDEN: &[(&str, Option<StateMachine>, &str)] = &[
        // The examples.
        ("CommandLine.Core.InstanceChooser.<Choose>g__choose|1_1", None, "CommandLine.Core.InstanceChooser.Choose.choose"),
        (
            "System.Text.RegularExpressions.RegexCompiler+<>c__DisplayClass157_0.<EmitTryMatchAtCurrentPosition>g__EmitNode|12",
            None,
            "System.Text.RegularExpressions.RegexCompiler.EmitTryMatchAtCurrentPosition.EmitNode",
        ),
        ("CommandLine.Core.InstanceBuilder+<>c__DisplayClass1_0<T>.<Build>b__5", None, "CommandLine.Core.InstanceBuilder.Build<T>.lambda#5"),
        (
            "System.Reflection.RuntimeMethodInfo.<get_Signature>g__LazyCreateSignature|25_0",
            None,
            "System.Reflection.RuntimeMethodInfo.get_Signature.LazyCreateSignature",
        ),
        ("Shop.OrderService+<HandleAsync>d__4.MoveNext", Some(Async), "Shop.OrderService.HandleAsync [async]"),
        ("Shop.Repo+<GetItems>d__3.MoveNext", Some(Iterator), "Shop.Repo.GetItems [iterator]"),
        // Lambdas: in the cached-lambda class, in a closure, static, generic.
        ("Shop.Program+<>c.<Main>b__0_0", None, "Shop.Program.Main.lambda#0"),
        ("Shop.Program+<>c.<Main>b__0_12", None, "Shop.Program.Main.lambda#12"),
        ("Shop.Program+<>c__DisplayClass0_0.<Main>b__1", None, "Shop.Program.Main.lambda#1"),
        ("Shop.Program+<>c__DisplayClass3_1.<Run>b__2", None, "Shop.Program.Run.lambda#2"),
        ("Shop.Program+<>c__DisplayClass1", None, "Shop.Program+<>c__DisplayClass1"),
        ("Shop.Program+<>c__DisplayClass1.<Main>b__0", None, "Shop.Program.Main.lambda#0"),
        ("Shop.Util+<>c__5<T>.<Sort>b__5_0", None, "Shop.Util.Sort<T>.lambda#0"),
        ("Shop.Util<T>+<>c.<Sort>b__5_0", None, "Shop.Util<T>.Sort.lambda#0"),
        ("Shop.Util<T>+<>c__DisplayClass5_0<U>.<Map>b__0", None, "Shop.Util<T>.Map<U>.lambda#0"),
        ("Shop.Order+<>c.<.ctor>b__2_0", None, "Shop.Order..ctor.lambda#0"),
        ("Shop.Order+<>c.<.cctor>b__9_0", None, "Shop.Order..cctor.lambda#0"),
        ("Shop.Order+<>c.<get_Total>b__4_0", None, "Shop.Order.get_Total.lambda#0"),
        ("Shop.Program+<>c.<Main>b__0_0#1", None, "Shop.Program.Main.lambda#0"),
        ("Shop.Outer<T>+Inner+<>c__DisplayClass2_0.<Run>b__1", None, "Shop.Outer<T>+Inner.Run.lambda#1"),
        ("Shop.Outer+Inner.<Run>b__2_0", None, "Shop.Outer+Inner.Run.lambda#0"),
        // Local functions: static, capturing, generic, in generic types, in top-level statements.
        ("Shop.Util.<Sort>g__Swap|5_0<T>", None, "Shop.Util.Sort.Swap<T>"),
        ("Shop.Util<T>.<Sort>g__Swap|5_0", None, "Shop.Util<T>.Sort.Swap"),
        ("Shop.Util+<>c__DisplayClass5_0<T>.<Sort>g__Swap|1", None, "Shop.Util.Sort<T>.Swap"),
        ("Program.<<Main>$>g__Helper|0_0", None, "Program.Main.Helper"),
        ("Program.<Main>$", None, "Program.Main"),
        ("Program+<>c.<<Main>$>b__0_1", None, "Program.Main.lambda#1"),
        // State machines: what the stack said, or nothing.
        ("Shop.OrderService+<HandleAsync>d__4.MoveNext", None, "Shop.OrderService.HandleAsync [state machine]"),
        ("Shop.Feed+<ReadAllAsync>d__2.MoveNext", Some(AsyncIterator), "Shop.Feed.ReadAllAsync [async iterator]"),
        ("Shop.Cache<TKey>+<GetAsync>d__7.MoveNext", Some(Async), "Shop.Cache<TKey>.GetAsync [async]"),
        ("Foo<T>+<Bar>d__3<U>.MoveNext", Some(Async), "Foo<T>.Bar<U> [async]"),
        ("Foo<T>+<Bar>d__3<U, V>.MoveNext", Some(Iterator), "Foo<T>.Bar<U, V> [iterator]"),
        ("Program+<<Main>$>d__0.MoveNext", Some(Async), "Program.Main [async]"),
        // Async lambdas and local functions: a state machine named after a generated method.
        ("Shop.Program+<>c+<<Main>b__0_0>d.MoveNext", Some(Async), "Shop.Program.Main.lambda#0 [async]"),
        ("Shop.Program+<>c__DisplayClass0_0+<<Main>b__1>d.MoveNext", Some(Async), "Shop.Program.Main.lambda#1 [async]"),
        ("Shop.Program+<<Main>g__LoadAsync|0_0>d.MoveNext", Some(Async), "Shop.Program.Main.LoadAsync [async]"),
        // Other members of a state machine.
        (
            "Shop.Repo+<GetItems>d__3.System.Collections.Generic.IEnumerator<System.Int32>.get_Current",
            None,
            "Shop.Repo.GetItems [iterator: get_Current]",
        ),
        ("Shop.Repo+<GetItems>d__3.System.IDisposable.Dispose", None, "Shop.Repo.GetItems [iterator: Dispose]"),
        (
            "Shop.Feed+<ReadAllAsync>d__2.System.Collections.Generic.IAsyncEnumerator<Shop.Item>.MoveNextAsync",
            None,
            "Shop.Feed.ReadAllAsync [async iterator: MoveNextAsync]",
        ),
        ("Shop.OrderService+<HandleAsync>d__4.SetStateMachine", None, "Shop.OrderService.HandleAsync [async: SetStateMachine]"),
        ("Shop.Repo+<GetItems>d__3..ctor", None, "Shop.Repo.GetItems [state machine: .ctor]"),
        // Mono's compiler.
        ("Shop.Program+<Main>c__AnonStorey0.<>m__0", None, "Shop.Program.Main.lambda#0"),
        ("Shop.Program+<Main>c__AnonStorey0<T>.<>m__3", None, "Shop.Program.Main<T>.lambda#3"),
        ("Shop.Program.<Main>m__1", None, "Shop.Program.Main.lambda#1"),
        ("Shop.Program+<Numbers>c__Iterator0.MoveNext", None, "Shop.Program.Numbers [iterator]"),
        ("Shop.Program+<Numbers>c__Iterator0.MoveNext", Some(Async), "Shop.Program.Numbers [iterator]"),
        ("Shop.Program+<RunAsync>c__async0.MoveNext", None, "Shop.Program.RunAsync [async]"),
        ("Shop.Program+<Numbers>c__Iterator0<T>.Dispose", None, "Shop.Program.Numbers<T> [iterator: Dispose]"),
        // Not generated, or not all the way: left as they are.
        ("System.Collections.Generic.List<T>.AddWithResize", None, "System.Collections.Generic.List<T>.AddWithResize"),
        ("Shop.Billing.Ledger<TKey>+Entry.Settle<TValue>", Some(Async), "Shop.Billing.Ledger<TKey>+Entry.Settle<TValue>"),
        ("Shop.Money.op_Addition", None, "Shop.Money.op_Addition"),
        ("Shop.Money.op_LessThan", None, "Shop.Money.op_LessThan"),
        ("Shop.Order..ctor", None, "Shop.Order..ctor"),
        ("Shop.Order..cctor", None, "Shop.Order..cctor"),
        ("Shop.Order.get_Total", None, "Shop.Order.get_Total"),
        ("Main", None, "Main"),
        ("", None, ""),
        ("[unknown code]", None, "[unknown code]"),
        ("[native code]", None, "[native code]"),
        ("libc.so.6!qsort", None, "libc.so.6!qsort"),
        ("libcoreclr.so+0x1a2b", None, "libcoreclr.so+0x1a2b"),
        ("libstdc++.so.6!std::vector<int>::push_back", None, "libstdc++.so.6!std::vector<int>::push_back"),
        ("<PrivateImplementationDetails>.ComputeStringHash", None, "<PrivateImplementationDetails>.ComputeStringHash"),
        ("<>f__AnonymousType0<<Name>j__TPar>.ToString", None, "<>f__AnonymousType0<<Name>j__TPar>.ToString"),
        ("<>f__AnonymousType0<<Name>j__TPar>.get_Name", None, "<>f__AnonymousType0<<Name>j__TPar>.get_Name"),
        ("Shop.Program+<>c__DisplayClass0_0..ctor", None, "Shop.Program+<>c__DisplayClass0_0..ctor"),
        ("Shop.Program+<>c..cctor", None, "Shop.Program+<>c..cctor"),
        ("Shop.Program+<>c__DisplayClass0_0.Helper", None, "Shop.Program+<>c__DisplayClass0_0.Helper"),
        ("Shop.Program+<>c", None, "Shop.Program+<>c"),
        ("Shop.Program+<Main>d__0", None, "Shop.Program+<Main>d__0"),
        ("Shop.Program.<Main>b__x", None, "Shop.Program.<Main>b__x"),
        ("Shop.Program.<Main>g__|0_1", None, "Shop.Program.<Main>g__|0_1"),
        ("Shop.Program.<Main>g__Local", None, "Shop.Program.<Main>g__Local"),
        ("Shop.Program+<Main>d__x.MoveNext", None, "Shop.Program+<Main>d__x.MoveNext"),
        ("Shop.Program.<Broken", None, "Shop.Program.<Broken"),
        ("Shop.Program.Broken>", None, "Shop.Program.Broken>"),
        ("Shop.Program.<Main>b__0_0.Extra", None, "Shop.Program.<Main>b__0_0.Extra"),
        ("Shop.<>c__DisplayClass0_0+<<<<<<Main>b__0>b__0>b__0>b__0>b__0>b__0>d.MoveNext", None, "Shop.<>c__DisplayClass0_0+<<<<<<Main>b__0>b__0>b__0>b__0>b__0>b__0>d.MoveNext"),
        ("Shop.Text.Cut…", None, "Shop.Text.Cut…"),
    ];

    #[test]
    fn golden_table() {
        let mut wrong = Vec::new();
        for &(raw, seen_as, readable) in GOLDEN {
            let actual = readable_name(raw, seen_as);
            if actual != readable {
                wrong.push(format!("{raw}\n    expected {readable}\n    got      {actual}"));
            }
        }
        assert!(wrong.is_empty(), "{} of {}:\n{}", wrong.len(), GOLDEN.len(), wrong.join("\n"));
    }

    /// Names come from the program's metadata (or a raw recording anyone can
    /// write): any string must come back as something, without a panic, and
    /// a name left alone must come back as it was.
    #[test]
    fn any_string_is_safe() {
        const PIECES: &[&str] = &[
            "<",
            ">",
            ".",
            "+",
            "..",
            "<>c",
            "__DisplayClass",
            "b__",
            "g__",
            "d__",
            "d",
            "|",
            "_",
            "#",
            "$",
            "0",
            "12",
            "Main",
            "MoveNext",
            "c__AnonStorey",
            "c__Iterator",
            "c__async",
            "m__",
            "é",
            "…",
            "<T>",
            "Shop",
            "",
        ];
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200_000 {
            let mut name = String::new();
            for _ in 0..(state % 12) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                name.push_str(PIECES[(state % PIECES.len() as u64) as usize]);
            }
            for seen_as in [None, Some(Async)] {
                let readable = readable_name(&name, seen_as);
                if !name.contains('<') {
                    assert_eq!(readable, name);
                }
                let _ = state_machine_from_callers(&name, [Some(name.as_str()), None]);
            }
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        }
    }

    #[test]
    fn names_left_alone_are_not_copied() {
        for name in ["System.Collections.Generic.List<T>.AddWithResize", "libc.so.6!qsort", "Shop.Order..ctor"] {
            assert!(matches!(readable_name(name, None), Cow::Borrowed(_)), "{name}");
        }
    }

    #[test]
    fn only_roslyn_move_next_depends_on_the_stack() {
        assert!(is_roslyn_move_next("Shop.OrderService+<HandleAsync>d__4.MoveNext"));
        assert!(is_roslyn_move_next("Foo<T>+<Bar>d__3<U>.MoveNext"));
        assert!(is_roslyn_move_next("Shop.Program+<>c+<<Main>b__0_0>d.MoveNext"));
        assert!(!is_roslyn_move_next("Shop.Program+<Numbers>c__Iterator0.MoveNext"));
        assert!(!is_roslyn_move_next("Shop.Repo+<GetItems>d__3.System.IDisposable.Dispose"));
        assert!(!is_roslyn_move_next("System.Collections.Generic.List<T>+Enumerator.MoveNext"));
        assert!(!is_roslyn_move_next("<GetItems>d__3.MoveNext"));
    }

    /// (state machine's MoveNext, callers nearest first, what they say).
    #[test]
    fn callers_tell_async_from_iterator() {
        let handle = "Shop.OrderService+<HandleAsync>d__4.MoveNext";
        let items = "Shop.Repo+<GetItems>d__3.MoveNext";
        let feed = "Shop.Feed+<ReadAllAsync>d__2.MoveNext";
        let generic = "Foo<T>+<Bar>d__3<U>.MoveNext";
        let start = "System.Runtime.CompilerServices.AsyncMethodBuilderCore.Start<TStateMachine>";
        let box_move_next = "System.Runtime.CompilerServices.AsyncTaskMethodBuilder<TResult>+AsyncStateMachineBox<TStateMachine>.MoveNext";
        let box_lambda = "System.Runtime.CompilerServices.AsyncTaskMethodBuilder<TResult>+AsyncStateMachineBox<TStateMachine>+<>c.<.cctor>b__18_0";
        let run = "System.Threading.ExecutionContext.RunInternal";
        type Case<'a> = (&'a str, &'a [Option<&'a str>], Option<StateMachine>);
        let cases: &[Case] = &[
            (handle, &[Some(start), Some("Shop.OrderService.HandleAsync"), Some("Shop.Program.Main")], Some(Async)),
            (handle, &[Some(box_lambda), Some(run), Some(box_move_next), Some("System.Threading.ThreadPoolWorkQueue.Dispatch")], Some(Async)),
            (handle, &[Some(box_move_next)], Some(Async)),
            // The start inlined into the method that began it.
            (handle, &[Some("Shop.OrderService.HandleAsync"), Some("Shop.Program.Main")], Some(Async)),
            (generic, &[Some("Foo<T>.Bar<U>")], Some(Async)),
            (generic, &[Some("Foo<T>.Barn")], Some(Iterator)),
            (items, &[Some("System.Linq.Enumerable.ToList<TSource>"), Some("Shop.Program.Main")], Some(Iterator)),
            (items, &[Some("Shop.Program.Main")], Some(Iterator)),
            (feed, &[Some(start), Some("Shop.Feed+<ReadAllAsync>d__2.System.Collections.Generic.IAsyncEnumerator<Shop.Item>.MoveNextAsync")], Some(AsyncIterator)),
            (feed, &[Some(start), Some(start), Some("Shop.Program+<Main>d__0.MoveNext")], Some(Async)),
            // A foreach in an async method.
            (items, &[Some("Shop.Program+<Main>d__0.MoveNext")], Some(Iterator)),
            // Nothing said: the stack's end, native or unknown code.
            (items, &[], None),
            (items, &[None, Some("Shop.Program.Main")], None),
            (items, &[Some("[unknown function 0x12]")], None),
            // Not a Roslyn state machine's MoveNext.
            ("Shop.Program+<Numbers>c__Iterator0.MoveNext", &[Some(start)], None),
            ("Shop.Program.Main", &[Some(start)], None),
        ];
        for (raw, callers, expected) in cases {
            assert_eq!(
                state_machine_from_callers(raw, callers.iter().copied()),
                *expected,
                "{raw} called from {callers:?}"
            );
        }
    }
}
