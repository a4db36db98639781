//! A reader of pickles of plain data: dicts, lists, tuples, sets, strings, bytes, integers,
//! floats, booleans and `None`, the form a PyTorch memory snapshot takes.
//!
//! It runs the pickle machine's data opcodes (protocols 0 to 5) and refuses every opcode that
//! names a class, builds an object or calls anything (`GLOBAL`, `STACK_GLOBAL`, `REDUCE`,
//! `BUILD`, `NEWOBJ`, `INST`, `OBJ`, persistent ids, extension codes, out-of-band buffers), so
//! reading a snapshot never runs code and never meets a value it cannot represent.
//!
//! A value the pickle refers to more than once (through its memo) is held once and shared, as
//! Python holds it: containers live in an arena and a [`Value`] names them by index. A snapshot
//! recorded with stacks shares each frame among every traceback that holds it and each traceback
//! among the events that have it; a reader that copies a shared value at each reference (as
//! serde-pickle 1.x does, whose per-reference counts then also fail such a pickle with "recursive
//! structure found") multiplies them. A container that contains itself is only a cycle of
//! indices here.

use std::collections::HashMap;

/// What the pickle could not be read as.
#[derive(Debug, thiserror::Error)]
pub enum PickleError {
    #[error("the pickle ends inside an opcode at byte {0}")]
    Truncated(usize),
    #[error(
        "opcode {name} at byte {pos} is refused: only plain data is read (dicts, lists, tuples, \
         sets, strings, bytes, numbers, booleans, None), never a class, an object, a call or a \
         buffer from outside the pickle"
    )]
    Class { name: &'static str, pos: usize },
    #[error("byte {pos}: {byte:#04x} is not a pickle opcode this reader knows")]
    Opcode { byte: u8, pos: usize },
    #[error("byte {pos}: {what}")]
    Malformed { what: String, pos: usize },
    #[error("the pickle ends without its STOP opcode")]
    NoStop,
}

/// Index of a string, bytes object, sequence or dict in a [`Pickle`]'s arena.
type Id = u32;

/// A value of the pickle: a scalar, or a container (or string) held in the [`Pickle`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer above `i64::MAX` that fits in 64 bits.
    UInt(u64),
    /// An integer beyond 64 bits: its value is not kept.
    BigInt,
    Float(f64),
    Str(Id),
    Bytes(Id),
    /// A list, set or frozenset.
    List(Id),
    Tuple(Id),
    Dict(Id),
}

/// A decoded pickle: its top value and the arena its containers live in.
#[derive(Debug)]
pub struct Pickle {
    arena: Arena,
    root: Value,
}

/// What the [`Value`]s of a pickle name, by index.
#[derive(Debug, Default)]
struct Arena {
    strings: Vec<Box<str>>,
    bytes: Vec<Box<[u8]>>,
    /// Lists, sets and tuples.
    seqs: Vec<Vec<Value>>,
    /// Dicts as their items in insertion order; a key set again is looked up from the end.
    dicts: Vec<Vec<(Value, Value)>>,
}

impl Pickle {
    /// The value the pickle stops with.
    pub fn root(&self) -> Value {
        self.root
    }

    /// `v`'s text, if it is a string.
    pub fn str(&self, v: Value) -> Option<&str> {
        match v {
            Value::Str(id) => Some(&self.arena.strings[id as usize]),
            _ => None,
        }
    }

    /// `v`'s items, if it is a list, set or tuple.
    pub fn items(&self, v: Value) -> Option<&[Value]> {
        match v {
            Value::List(id) | Value::Tuple(id) => Some(&self.arena.seqs[id as usize]),
            _ => None,
        }
    }

    /// The value of `key` in `dict`, if `dict` is a dict that has it (the last one set, as in
    /// Python).
    pub fn get(&self, dict: Value, key: &str) -> Option<Value> {
        let Value::Dict(id) = dict else {
            return None;
        };
        self.arena.dicts[id as usize]
            .iter()
            .rev()
            .find(|(k, _)| self.str(*k) == Some(key))
            .map(|&(_, v)| v)
    }

    /// What `v` is, in Python's words, for messages.
    pub fn kind(v: Value) -> &'static str {
        match v {
            Value::None => "None",
            Value::Bool(_) => "a bool",
            Value::Int(_) | Value::UInt(_) | Value::BigInt => "an int",
            Value::Float(_) => "a float",
            Value::Str(_) => "a str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "a list",
            Value::Tuple(_) => "a tuple",
            Value::Dict(_) => "a dict",
        }
    }
}

/// Reads one pickle from `input` (what follows its `STOP` is ignored, as Python ignores it).
pub fn read(input: &[u8]) -> Result<Pickle, PickleError> {
    let mut m = Machine {
        input,
        pos: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        arena: Arena::default(),
    };
    let root = m.run()?;
    Ok(Pickle {
        arena: m.arena,
        root,
    })
}

struct Machine<'a> {
    input: &'a [u8],
    pos: usize,
    stack: Vec<Value>,
    /// Stack lengths at each `MARK` not yet taken.
    marks: Vec<usize>,
    memo: HashMap<u64, Value>,
    arena: Arena,
}

/// The opcodes that name a class, build an object, call, or take a value from outside the
/// pickle: refused, by name.
fn class_opcode(op: u8) -> Option<&'static str> {
    Some(match op {
        b'c' => "GLOBAL",
        0x93 => "STACK_GLOBAL",
        b'R' => "REDUCE",
        b'b' => "BUILD",
        0x81 => "NEWOBJ",
        0x92 => "NEWOBJ_EX",
        b'i' => "INST",
        b'o' => "OBJ",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return None,
    })
}

impl<'a> Machine<'a> {
    /// Runs the pickle to its `STOP`: the value it stops with.
    fn run(&mut self) -> Result<Value, PickleError> {
        while self.pos < self.input.len() {
            let at = self.pos;
            let op = self.input[at];
            self.pos += 1;
            if let Some(name) = class_opcode(op) {
                return Err(PickleError::Class { name, pos: at });
            }
            match op {
                0x80 => {
                    let proto = self.take(1)?[0];
                    if proto > 5 {
                        return Err(self.malformed(at, format!("protocol {proto} (5 at most)")));
                    }
                }
                0x95 => {
                    self.take(8)?;
                }
                b'.' => return self.pop(at),
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    self.pop(at)?;
                }
                b'1' => {
                    self.pop_mark(at)?;
                }
                b'2' => {
                    let top = self.top(at)?;
                    self.stack.push(top);
                }
                b'}' => self.push_dict(Vec::new(), at)?,
                b']' | 0x8f => self.push_seq(Vec::new(), false, at)?,
                b')' => self.push_seq(Vec::new(), true, at)?,
                b'd' => {
                    let items = self.pop_mark(at)?;
                    let pairs = self.pairs(items, at)?;
                    self.push_dict(pairs, at)?;
                }
                b'l' | 0x91 => {
                    let items = self.pop_mark(at)?;
                    self.push_seq(items, false, at)?;
                }
                b't' => {
                    let items = self.pop_mark(at)?;
                    self.push_seq(items, true, at)?;
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    if self.stack.len() < self.floor() + n {
                        return Err(self.malformed(at, "TUPLE of items the stack lacks".into()));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.push_seq(items, true, at)?;
                }
                b's' => {
                    let v = self.pop(at)?;
                    let k = self.pop(at)?;
                    self.dict_of_top(at)?.push((k, v));
                }
                b'u' => {
                    let items = self.pop_mark(at)?;
                    let pairs = self.pairs(items, at)?;
                    self.dict_of_top(at)?.extend(pairs);
                }
                b'a' => {
                    let v = self.pop(at)?;
                    self.seq_of_top(at)?.push(v);
                }
                b'e' | 0x90 => {
                    let items = self.pop_mark(at)?;
                    self.seq_of_top(at)?.extend(items);
                }
                b'N' => self.stack.push(Value::None),
                0x88 => self.stack.push(Value::Bool(true)),
                0x89 => self.stack.push(Value::Bool(false)),
                b'J' => {
                    let v = i32::from_le_bytes(self.take_array()?);
                    self.stack.push(Value::Int(v.into()));
                }
                b'K' => {
                    let v = self.take(1)?[0];
                    self.stack.push(Value::Int(v.into()));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.take_array()?);
                    self.stack.push(Value::Int(v.into()));
                }
                0x8a => {
                    let n = self.take(1)?[0];
                    let b = self.take(n.into())?;
                    self.stack.push(long(b));
                }
                0x8b => {
                    let n = self.len32(at)?;
                    let b = self.take(n)?;
                    self.stack.push(long(b));
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.take_array()?);
                    self.stack.push(Value::Float(v));
                }
                b'I' | b'L' => {
                    let line = self.line()?;
                    let v = text_int(line).ok_or_else(|| self.malformed(at, "an INT".into()))?;
                    self.stack.push(v);
                }
                b'F' => {
                    let line = self.line()?;
                    let v = std::str::from_utf8(line)
                        .ok()
                        .and_then(|s| s.trim().parse().ok())
                        .ok_or_else(|| self.malformed(at, "a FLOAT".into()))?;
                    self.stack.push(Value::Float(v));
                }
                b'X' => {
                    let n = self.len32(at)?;
                    self.push_str(n, at)?;
                }
                0x8c => {
                    let n = self.take(1)?[0];
                    self.push_str(n.into(), at)?;
                }
                0x8d => {
                    let n = self.len64(at)?;
                    self.push_str(n, at)?;
                }
                b'C' | b'U' => {
                    let n = self.take(1)?[0];
                    self.push_bytes(n.into(), op == b'U', at)?;
                }
                b'B' | b'T' => {
                    let n = self.len32(at)?;
                    self.push_bytes(n, op == b'T', at)?;
                }
                0x8e | 0x96 => {
                    let n = self.len64(at)?;
                    self.push_bytes(n, false, at)?;
                }
                0x94 => {
                    let top = self.top(at)?;
                    let index = self.memo.len() as u64;
                    self.memo.insert(index, top);
                }
                b'q' => {
                    let index = self.take(1)?[0];
                    self.put(index.into(), at)?;
                }
                b'r' => {
                    let index = u32::from_le_bytes(self.take_array()?);
                    self.put(index.into(), at)?;
                }
                b'p' => {
                    let index = self.line_index(at)?;
                    self.put(index, at)?;
                }
                b'h' => {
                    let index = self.take(1)?[0];
                    self.get(index.into(), at)?;
                }
                b'j' => {
                    let index = u32::from_le_bytes(self.take_array()?);
                    self.get(index.into(), at)?;
                }
                b'g' => {
                    let index = self.line_index(at)?;
                    self.get(index, at)?;
                }
                b'V' => {
                    let line = self.line()?;
                    let text = raw_unicode_escape(line)
                        .ok_or_else(|| self.malformed(at, "a UNICODE string".into()))?;
                    self.push_text(&text, at)?;
                }
                b'S' => {
                    return Err(self.malformed(
                        at,
                        "a Python 2 STRING (write the snapshot with Python 3)".into(),
                    ))
                }
                byte => return Err(PickleError::Opcode { byte, pos: at }),
            }
        }
        Err(PickleError::NoStop)
    }

    fn malformed(&self, pos: usize, what: String) -> PickleError {
        PickleError::Malformed { what, pos }
    }

    /// The next `n` bytes, an opcode's argument.
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.input.len())
            .ok_or(PickleError::Truncated(self.pos))?;
        let b = &self.input[self.pos..end];
        self.pos = end;
        Ok(b)
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N], PickleError> {
        let mut a = [0; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn len32(&mut self, at: usize) -> Result<usize, PickleError> {
        let n = i32::from_le_bytes(self.take_array()?);
        usize::try_from(n).map_err(|_| self.malformed(at, format!("a negative length {n}")))
    }

    fn len64(&mut self, at: usize) -> Result<usize, PickleError> {
        let n = u64::from_le_bytes(self.take_array()?);
        usize::try_from(n).map_err(|_| self.malformed(at, format!("a length of {n} bytes")))
    }

    /// The text up to the next newline (protocol 0's arguments).
    fn line(&mut self) -> Result<&'a [u8], PickleError> {
        let rest = &self.input[self.pos..];
        let n = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(PickleError::Truncated(self.pos))?;
        self.pos += n + 1;
        Ok(&rest[..n])
    }

    fn line_index(&mut self, at: usize) -> Result<u64, PickleError> {
        let line = self.line()?;
        std::str::from_utf8(line)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| self.malformed(at, "a memo index".into()))
    }

    /// The lowest stack index the current mark leaves to the opcodes after it.
    fn floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self, at: usize) -> Result<Value, PickleError> {
        if self.stack.len() <= self.floor() {
            return Err(self.malformed(at, "an opcode takes from an empty stack".into()));
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    fn top(&self, at: usize) -> Result<Value, PickleError> {
        match self.stack.last() {
            Some(&v) if self.stack.len() > self.floor() => Ok(v),
            _ => Err(self.malformed(at, "an opcode reads an empty stack".into())),
        }
    }

    fn pop_mark(&mut self, at: usize) -> Result<Vec<Value>, PickleError> {
        let mark = self.marks.pop().ok_or_else(|| {
            self.malformed(at, "an opcode takes to a MARK there is none of".into())
        })?;
        Ok(self.stack.split_off(mark))
    }

    fn pairs(&self, items: Vec<Value>, at: usize) -> Result<Vec<(Value, Value)>, PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.malformed(at, "a dict's items are an odd count".into()));
        }
        Ok(items.chunks_exact(2).map(|p| (p[0], p[1])).collect())
    }

    fn next_id(&self, len: usize, at: usize) -> Result<Id, PickleError> {
        Id::try_from(len).map_err(|_| self.malformed(at, "too many values".into()))
    }

    fn push_dict(&mut self, items: Vec<(Value, Value)>, at: usize) -> Result<(), PickleError> {
        let id = self.next_id(self.arena.dicts.len(), at)?;
        self.arena.dicts.push(items);
        self.stack.push(Value::Dict(id));
        Ok(())
    }

    fn push_seq(&mut self, items: Vec<Value>, tuple: bool, at: usize) -> Result<(), PickleError> {
        let id = self.next_id(self.arena.seqs.len(), at)?;
        self.arena.seqs.push(items);
        self.stack.push(if tuple {
            Value::Tuple(id)
        } else {
            Value::List(id)
        });
        Ok(())
    }

    fn push_str(&mut self, n: usize, at: usize) -> Result<(), PickleError> {
        let text = std::str::from_utf8(self.take(n)?)
            .map_err(|e| self.malformed(at, format!("a string that is not UTF-8 ({e})")))?;
        self.push_text(text, at)
    }

    fn push_text(&mut self, text: &str, at: usize) -> Result<(), PickleError> {
        let id = self.next_id(self.arena.strings.len(), at)?;
        self.arena.strings.push(text.into());
        self.stack.push(Value::Str(id));
        Ok(())
    }

    /// Bytes, or for Python 2's `str` (`text`) a string where they are UTF-8.
    fn push_bytes(&mut self, n: usize, text: bool, at: usize) -> Result<(), PickleError> {
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) if text => self.push_text(s, at),
            _ => {
                let id = self.next_id(self.arena.bytes.len(), at)?;
                self.arena.bytes.push(b.into());
                self.stack.push(Value::Bytes(id));
                Ok(())
            }
        }
    }

    fn put(&mut self, index: u64, at: usize) -> Result<(), PickleError> {
        let top = self.top(at)?;
        self.memo.insert(index, top);
        Ok(())
    }

    fn get(&mut self, index: u64, at: usize) -> Result<(), PickleError> {
        let v = *self
            .memo
            .get(&index)
            .ok_or_else(|| self.malformed(at, format!("memo {index} was never stored")))?;
        self.stack.push(v);
        Ok(())
    }

    fn dict_of_top(&mut self, at: usize) -> Result<&mut Vec<(Value, Value)>, PickleError> {
        match self.top(at)? {
            Value::Dict(id) => Ok(&mut self.arena.dicts[id as usize]),
            v => Err(self.malformed(at, format!("SETITEM on {}", Pickle::kind(v)))),
        }
    }

    fn seq_of_top(&mut self, at: usize) -> Result<&mut Vec<Value>, PickleError> {
        match self.top(at)? {
            Value::List(id) => Ok(&mut self.arena.seqs[id as usize]),
            v => Err(self.malformed(at, format!("APPEND to {}", Pickle::kind(v)))),
        }
    }
}

/// `LONG1`/`LONG4`'s little-endian two's complement integer.
fn long(b: &[u8]) -> Value {
    if b.is_empty() {
        return Value::Int(0);
    }
    if b.len() > 16 {
        return Value::BigInt;
    }
    let negative = b[b.len() - 1] & 0x80 != 0;
    let mut bytes = [if negative { 0xff } else { 0 }; 16];
    bytes[..b.len()].copy_from_slice(b);
    int(i128::from_le_bytes(bytes))
}

/// Protocol 0's `UNICODE` text: Latin-1 bytes, but for `\uXXXX` and `\UXXXXXXXX` escapes
/// (Python writes a backslash itself as `\u005c`).
fn raw_unicode_escape(line: &[u8]) -> Option<String> {
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < line.len() {
        let digits = match line.get(i..i + 2) {
            Some(b"\\u") => 4,
            Some(b"\\U") => 8,
            _ => 0,
        };
        if digits == 0 {
            out.push(char::from(line[i]));
            i += 1;
            continue;
        }
        let hex = std::str::from_utf8(line.get(i + 2..i + 2 + digits)?).ok()?;
        out.push(char::from_u32(u32::from_str_radix(hex, 16).ok()?)?);
        i += 2 + digits;
    }
    Some(out)
}

/// An integer as the narrowest [`Value`] that holds it.
fn int(v: i128) -> Value {
    if let Ok(v) = i64::try_from(v) {
        Value::Int(v)
    } else if let Ok(v) = u64::try_from(v) {
        Value::UInt(v)
    } else {
        Value::BigInt
    }
}

/// Protocol 0's `INT` and `LONG` text: `00` and `01` are False and True, a trailing `L` is
/// Python 2's long.
fn text_int(line: &[u8]) -> Option<Value> {
    let s = std::str::from_utf8(line).ok()?.trim();
    match s {
        "00" => return Some(Value::Bool(false)),
        "01" => return Some(Value::Bool(true)),
        _ => {}
    }
    let s = s.strip_suffix('L').unwrap_or(s);
    let digits = s.strip_prefix('-').unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some(s.parse::<i128>().map_or(Value::BigInt, int))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn scalars_of_every_width_read_as_python_wrote_them() {
        // `pickle.dumps((1, 2, 3, 4, -5, 2**64, 2**63, -2**63, 2**200, 1.5, True, None, b"ab",
        // "é"), protocol=4)`: a tuple of more than three items (MARK ... TUPLE).
        let p = read(&unhex(concat!(
            "8004956200000000000000284b014b024b034b044afbffffff8a09000000000000000001",
            "8a090000000000000080008a0800000000000000808a1a00000000000000000000000000",
            "00000000000000000000000001473ff8000000000000884e43026162948c02c3a99474942e"
        )))
        .unwrap();
        let items = p.items(p.root()).unwrap();
        assert!(matches!(p.root(), Value::Tuple(_)));
        assert_eq!(
            items[..12],
            [
                Value::Int(1),
                Value::Int(2),
                Value::Int(3),
                Value::Int(4),
                Value::Int(-5),
                Value::BigInt,
                Value::UInt(1 << 63),
                Value::Int(i64::MIN),
                Value::BigInt,
                Value::Float(1.5),
                Value::Bool(true),
                Value::None,
            ]
        );
        assert!(matches!(items[12], Value::Bytes(_)));
        assert_eq!(p.str(items[13]), Some("é"));
    }

    #[test]
    fn protocol_0_numbers_and_memo_and_a_list_that_holds_itself() {
        // A list of 1, True, a long beyond 64 bits, 1.5 and itself (PUT 0, GET 0), then DUP and
        // POP, which leave it as it was.
        let p =
            read(b"(lp0\nI1\naI01\naL123456789012345678901234567890L\naF1.5\nag0\na20.").unwrap();
        let items = p.items(p.root()).unwrap();
        assert_eq!(
            items,
            [
                Value::Int(1),
                Value::Bool(true),
                Value::BigInt,
                Value::Float(1.5),
                p.root()
            ]
        );
        assert_eq!(p.items(items[4]).unwrap().len(), 5);
    }

    #[test]
    fn protocol_0_strings_are_latin_1_with_escapes() {
        // `pickle.dumps(["é\\x\n", "\U0001F600"], protocol=0)`
        let p = read(b"(lp0\nV\xe9\\u005cx\\u000a\np1\naV\\U0001f600\np2\na.").unwrap();
        let items = p.items(p.root()).unwrap();
        assert_eq!(p.str(items[0]), Some("é\\x\n"));
        assert_eq!(p.str(items[1]), Some("\u{1F600}"));
    }

    /// `v` in the canonical form `pickle_cases.py` prints.
    fn canon(p: &Pickle, v: Value) -> serde_json::Value {
        use serde_json::json;
        let all = |items: &[Value]| items.iter().map(|&x| canon(p, x)).collect::<Vec<_>>();
        match v {
            Value::None => serde_json::Value::Null,
            Value::Bool(b) => json!(b),
            Value::Int(i) => json!({ "int": i.to_string() }),
            Value::UInt(u) => json!({ "int": u.to_string() }),
            Value::BigInt => json!("big"),
            Value::Float(f) => json!({ "float": f }),
            Value::Str(_) => json!({ "str": p.str(v).unwrap() }),
            Value::Bytes(id) => {
                let hex: String = p.arena.bytes[id as usize]
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect();
                json!({ "bytes": hex })
            }
            Value::List(_) => json!({ "list": all(p.items(v).unwrap()) }),
            Value::Tuple(_) => json!({ "tuple": all(p.items(v).unwrap()) }),
            Value::Dict(id) => {
                let pairs: Vec<_> = p.arena.dicts[id as usize]
                    .iter()
                    .map(|&(k, x)| json!([canon(p, k), canon(p, x)]))
                    .collect();
                json!({ "dict": pairs })
            }
        }
    }

    /// Python's own pickles of random plain values (ints of every width, floats, strings with
    /// escapes, bytes, nested and shared lists, tuples and dicts) at protocols 0 to 5 read as
    /// Python reads them.
    #[test]
    fn reads_what_python_pickles_at_every_protocol() {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/src/trace/pickle_cases.py");
        let mut cases = 0;
        for seed in 1..=5 {
            let out = std::process::Command::new("python3")
                .arg(script)
                .arg(seed.to_string())
                .output()
                .expect("python3 runs (it is on every machine the tests run on)");
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            for line in String::from_utf8(out.stdout).unwrap().lines() {
                let mut parts = line.splitn(3, ' ');
                let (protocol, hex, want) = (
                    parts.next().unwrap(),
                    parts.next().unwrap(),
                    parts.next().unwrap(),
                );
                let p =
                    read(&unhex(hex)).unwrap_or_else(|e| panic!("protocol {protocol} {hex}: {e}"));
                let want: serde_json::Value = serde_json::from_str(want).unwrap();
                assert_eq!(canon(&p, p.root()), want, "protocol {protocol} {hex}");
                cases += 1;
            }
        }
        assert_eq!(cases, 5 * 6 * 20);
    }

    #[test]
    fn a_dict_keeps_the_last_value_of_a_key_set_twice() {
        // `}` then SETITEMS of ("a", 1, "a", 2).
        let p = read(b"}(\x8c\x01aK\x01\x8c\x01aK\x02u.").unwrap();
        assert_eq!(p.get(p.root(), "a"), Some(Value::Int(2)));
        assert_eq!(p.get(p.root(), "b"), None);
    }

    #[test]
    fn refusals_name_the_opcode_and_where() {
        let err = read(b"\x80\x04cos\nsystem\n.").unwrap_err();
        assert_eq!(
            err.to_string().split(':').next(),
            Some("opcode GLOBAL at byte 2 is refused")
        );
        assert!(matches!(
            read(b"]a."),
            Err(PickleError::Malformed { pos: 1, .. })
        ));
        assert!(matches!(
            read(b"\x8d\xff\xff\xff\xff\xff\xff\xff\x7f"),
            Err(PickleError::Truncated(9))
        ));
        assert!(matches!(read(b"K\x01"), Err(PickleError::NoStop)));
        assert!(matches!(
            read(b"h\x05."),
            Err(PickleError::Malformed { .. })
        ));
    }
}
