//! `IMetaDataImport` / `IMetaDataImport2`: reading type and method names
//! from a module's metadata.

use std::ffi::c_void;
use std::ptr::NonNull;

use crate::{check, HResult, MdToken, HRESULT};

/// Slot numbers from `cor.h` (IUnknown is 0..2; IMetaDataImport has 62
/// methods, IMetaDataImport2 follows at 65).
mod slot {
    pub const CLOSE_ENUM: usize = 3;
    pub const FIND_TYPE_DEF_BY_NAME: usize = 9;
    pub const ENUM_METHODS_WITH_NAME: usize = 19;
    pub const ENUM_INTERFACE_IMPLS: usize = 7;
    pub const GET_TYPE_DEF_PROPS: usize = 12;
    pub const GET_INTERFACE_IMPL_PROPS: usize = 13;
    pub const GET_TYPE_REF_PROPS: usize = 14;
    pub const GET_METHOD_PROPS: usize = 30;
    pub const GET_SIG_FROM_TOKEN: usize = 41;
    pub const ENUM_SIGNATURES: usize = 49;
    pub const GET_NESTED_CLASS_PROPS: usize = 62;
    pub const ENUM_GENERIC_PARAMS: usize = 65;
    pub const GET_GENERIC_PARAM_PROPS: usize = 66;
}

const _: () = assert!(slot::ENUM_GENERIC_PARAMS == 3 + 62);
// `cor.h` declares them in this order: CloseEnum, CountEnum, ResetEnum,
// EnumTypeDefs, EnumInterfaceImpls, EnumTypeRefs, FindTypeDefByName,
// GetScopeProps, GetModuleFromScope, GetTypeDefProps, GetInterfaceImplProps,
// GetTypeRefProps.
const _: () = assert!(slot::ENUM_INTERFACE_IMPLS == slot::CLOSE_ENUM + 4);
const _: () = assert!(slot::GET_TYPE_DEF_PROPS == slot::CLOSE_ENUM + 9);
const _: () = assert!(slot::GET_TYPE_REF_PROPS == slot::GET_INTERFACE_IMPL_PROPS + 1);
const _: () = assert!(slot::GET_INTERFACE_IMPL_PROPS == slot::GET_TYPE_DEF_PROPS + 1);
// FindTypeDefByName follows EnumTypeRefs (8); after GetTypeRefProps come
// ResolveTypeRef, EnumMembers, EnumMembersWithName, EnumMethods and
// EnumMethodsWithName; GetMethodProps is 11 further on (EnumFields,
// EnumFieldsWithName, EnumParams, EnumMemberRefs, EnumMethodImpls,
// EnumPermissionSets, FindMember, FindMethod, FindField, FindMemberRef).
const _: () = assert!(slot::FIND_TYPE_DEF_BY_NAME == slot::ENUM_INTERFACE_IMPLS + 2);
const _: () = assert!(slot::ENUM_METHODS_WITH_NAME == slot::GET_TYPE_REF_PROPS + 5);
const _: () = assert!(slot::GET_METHOD_PROPS == slot::ENUM_METHODS_WITH_NAME + 11);
// Then GetMemberRefProps, EnumProperties, EnumEvents, GetEventProps,
// EnumMethodSemantics, GetMethodSemantics, GetClassLayout, GetFieldMarshal,
// GetRVA, GetPermissionSetProps, GetSigFromToken; then GetModuleRefProps,
// EnumModuleRefs, GetTypeSpecFromToken, GetNameFromToken,
// EnumUnresolvedMethods, GetUserString, GetPinvokeMap, EnumSignatures; and
// GetNestedClassProps, IMetaDataImport's last, 13 further on.
const _: () = assert!(slot::GET_SIG_FROM_TOKEN == slot::GET_METHOD_PROPS + 11);
const _: () = assert!(slot::ENUM_SIGNATURES == slot::GET_SIG_FROM_TOKEN + 8);
const _: () = assert!(slot::GET_NESTED_CLASS_PROPS == slot::ENUM_SIGNATURES + 13);

/// `IMetaDataEmit` slots (cor.h: SetModuleProps is 3; GetTokenFromSig
/// follows SetRVA, the 20th method).
mod emit_slot {
    pub const GET_TOKEN_FROM_SIG: usize = 23;
}

/// Token types (`CorTokenType`, the top byte of a token).
const MDT_TYPE_REF: u32 = 0x0100_0000;
const MDT_TYPE_DEF: u32 = 0x0200_0000;
const MDT_MASK: u32 = 0xFF00_0000;

/// `tdVisibilityMask`; values at or above `tdNestedPublic` mean nested.
const TD_VISIBILITY_MASK: u32 = 0x7;
const TD_NESTED_PUBLIC: u32 = 0x2;

/// Longest name we ask the runtime for, in UTF-16 units.
const NAME_CAPACITY: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodProps {
    pub name: String,
    pub class_token: MdToken,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeDefProps {
    /// Namespace-qualified for top-level types, bare for nested ones, with the
    /// CLR's arity suffix (`Ledger`1`).
    pub name: String,
    pub flags: u32,
}

impl TypeDefProps {
    pub fn is_nested(&self) -> bool {
        self.flags & TD_VISIBILITY_MASK >= TD_NESTED_PUBLIC
    }
}

/// An open metadata scope. Releases its reference when dropped.
#[derive(Debug)]
pub struct MetaDataImport {
    this: NonNull<c_void>,
    has_generics: bool,
}

// SAFETY: the runtime's public metadata importer is safe to call from any
// thread; corsnap also only uses each handle from one thread at a time.
unsafe impl Send for MetaDataImport {}

impl Drop for MetaDataImport {
    fn drop(&mut self) {
        // SAFETY: we own one reference.
        unsafe { crate::info::release(self.this) }
    }
}

pub(crate) fn utf16_until_nul(units: &[u16]) -> String {
    let end = units.iter().position(|&c| c == 0).unwrap_or(units.len());
    String::from_utf16_lossy(&units[..end])
}

impl MetaDataImport {
    /// # Safety
    /// `this` must be an owned reference to `IMetaDataImport2` when
    /// `has_generics`, else to `IMetaDataImport`.
    pub(crate) unsafe fn from_raw(this: NonNull<c_void>, has_generics: bool) -> Self {
        MetaDataImport { this, has_generics }
    }

    /// # Safety
    /// `F` must be the slot's true signature.
    unsafe fn method<F: Copy>(&self, slot: usize) -> F {
        // SAFETY: per the caller; slots used are inside the vtable we hold
        // (generic-parameter slots are only read when `has_generics`).
        unsafe {
            let vtbl = *(self.this.as_ptr() as *const *const *const c_void);
            std::mem::transmute_copy::<*const c_void, F>(&*vtbl.add(slot))
        }
    }

    /// The `TypeDef` named `name` (namespace and name, or a nested type's
    /// own name with its `enclosing` class; 0 for none).
    pub fn find_type_def_by_name(&self, name: &str, enclosing: MdToken) -> HResult<MdToken> {
        type F = unsafe extern "C" fn(*mut c_void, *const u16, MdToken, *mut MdToken) -> HRESULT;
        let name: Vec<u16> = name.encode_utf16().chain([0]).collect();
        let mut token = 0;
        // SAFETY: FindTypeDefByName(LPCWSTR, mdToken, mdTypeDef*); the name
        // outlives the call.
        unsafe {
            let f: F = self.method(slot::FIND_TYPE_DEF_BY_NAME);
            check(f(self.this.as_ptr(), name.as_ptr(), enclosing, &mut token))?;
        }
        Ok(token)
    }

    /// The first method of `type_def` named `name`, whatever its signature
    /// (`CLDB_E_RECORD_NOTFOUND` for none). Asked of `EnumMethodsWithName`,
    /// which compares the names of the type's own methods: `FindMethod`
    /// first builds a hash of every member of the module, 24 ms of the
    /// agent's start-up for CoreLib (measured on .NET 10).
    pub fn find_method(&self, type_def: MdToken, name: &str) -> HResult<MdToken> {
        type Enum = unsafe extern "C" fn(
            *mut c_void,
            *mut *mut c_void,
            MdToken,
            *const u16,
            *mut MdToken,
            u32,
            *mut u32,
        ) -> HRESULT;
        type Close = unsafe extern "C" fn(*mut c_void, *mut c_void);
        let name: Vec<u16> = name.encode_utf16().chain([0]).collect();
        let (mut token, mut count) = (0u32, 0u32);
        let mut henum: *mut c_void = std::ptr::null_mut();
        // SAFETY: EnumMethodsWithName(HCORENUM*, mdTypeDef, LPCWSTR,
        // mdMethodDef[], ULONG, ULONG*) with room for one token; the name
        // outlives the call; then CloseEnum on the same HCORENUM.
        let hr = unsafe {
            let enumerate: Enum = self.method(slot::ENUM_METHODS_WITH_NAME);
            let hr = enumerate(self.this.as_ptr(), &mut henum, type_def, name.as_ptr(), &mut token, 1, &mut count);
            if !henum.is_null() {
                let close: Close = self.method(slot::CLOSE_ENUM);
                close(self.this.as_ptr(), henum);
            }
            hr
        };
        check(hr)?;
        if count == 0 {
            return Err(crate::HResultError(crate::hr::CLDB_E_RECORD_NOTFOUND));
        }
        Ok(token)
    }

    /// The first of `wanted` that the module's `StandAloneSig` table holds,
    /// byte for byte: its index in `wanted` and its token. Reads the table
    /// (3,600 signatures in CoreLib 10.0) a batch at a time.
    pub fn find_signature(&self, wanted: &[&[u8]]) -> HResult<Option<(usize, MdToken)>> {
        type Enum = unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut MdToken, u32, *mut u32) -> HRESULT;
        type GetSig = unsafe extern "C" fn(*mut c_void, MdToken, *mut *const u8, *mut u32) -> HRESULT;
        type Close = unsafe extern "C" fn(*mut c_void, *mut c_void);
        let mut best: Option<(usize, MdToken)> = None;
        let mut batch = [0u32; 512];
        let mut henum: *mut c_void = std::ptr::null_mut();
        let result = loop {
            let mut count = 0u32;
            // SAFETY: EnumSignatures(HCORENUM*, mdSignature[], ULONG, ULONG*)
            // into `batch`, the same enumerator each time (closed below).
            let hr = unsafe {
                let enumerate: Enum = self.method(slot::ENUM_SIGNATURES);
                enumerate(self.this.as_ptr(), &mut henum, batch.as_mut_ptr(), batch.len() as u32, &mut count)
            };
            if let Err(e) = check(hr) {
                break Err(e);
            }
            let count = (count as usize).min(batch.len());
            if count == 0 {
                break Ok(best);
            }
            for &token in &batch[..count] {
                let (mut blob, mut len) = (std::ptr::null::<u8>(), 0u32);
                // SAFETY: GetSigFromToken(mdSignature, PCCOR_SIGNATURE*, ULONG*);
                // the blob lives in the module's metadata, which this scope
                // keeps, and is only read before the next call.
                let signature = unsafe {
                    let get: GetSig = self.method(slot::GET_SIG_FROM_TOKEN);
                    if check(get(self.this.as_ptr(), token, &mut blob, &mut len)).is_err() || blob.is_null() {
                        continue;
                    }
                    std::slice::from_raw_parts(blob, len as usize)
                };
                if let Some(i) = wanted.iter().position(|w| *w == signature) {
                    if best.is_none_or(|(b, _)| i < b) {
                        best = Some((i, token));
                    }
                }
            }
        };
        if !henum.is_null() {
            // SAFETY: CloseEnum on the enumerator EnumSignatures made.
            unsafe {
                let close: Close = self.method(slot::CLOSE_ENUM);
                close(self.this.as_ptr(), henum);
            }
        }
        result
    }

    pub fn get_method_props(&self, method: MdToken) -> HResult<MethodProps> {
        type F = unsafe extern "C" fn(
            *mut c_void,
            MdToken,
            *mut MdToken,
            *mut u16,
            u32,
            *mut u32,
            *mut u32,
            *mut *const u8,
            *mut u32,
            *mut u32,
            *mut u32,
        ) -> HRESULT;
        let mut class_token = 0;
        let mut buf = [0u16; NAME_CAPACITY];
        let mut len = 0u32;
        // SAFETY: GetMethodProps; optional outs passed as null.
        unsafe {
            let f: F = self.method(slot::GET_METHOD_PROPS);
            check(f(
                self.this.as_ptr(),
                method,
                &mut class_token,
                buf.as_mut_ptr(),
                buf.len() as u32,
                &mut len,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            ))?;
        }
        Ok(MethodProps { name: utf16_until_nul(&buf[..(len as usize).min(buf.len())]), class_token })
    }

    pub fn get_type_def_props(&self, type_def: MdToken) -> HResult<TypeDefProps> {
        type F = unsafe extern "C" fn(*mut c_void, MdToken, *mut u16, u32, *mut u32, *mut u32, *mut MdToken) -> HRESULT;
        let mut buf = [0u16; NAME_CAPACITY];
        let (mut len, mut flags, mut extends) = (0u32, 0u32, 0u32);
        // SAFETY: GetTypeDefProps.
        unsafe {
            let f: F = self.method(slot::GET_TYPE_DEF_PROPS);
            check(f(
                self.this.as_ptr(),
                type_def,
                buf.as_mut_ptr(),
                buf.len() as u32,
                &mut len,
                &mut flags,
                &mut extends,
            ))?;
        }
        Ok(TypeDefProps { name: utf16_until_nul(&buf[..(len as usize).min(buf.len())]), flags })
    }

    /// The namespace-qualified names of the interfaces a type declares it
    /// implements (`System.Runtime.CompilerServices.IAsyncStateMachine`),
    /// those named by a `TypeDef` or `TypeRef`. An instantiated generic
    /// interface (`IEnumerator<int>`, a `TypeSpec`) is left out: its name
    /// would need its signature read. At most 64 interfaces are read.
    pub fn interface_names(&self, type_def: MdToken) -> HResult<Vec<String>> {
        type ImplProps = unsafe extern "C" fn(*mut c_void, MdToken, *mut MdToken, *mut MdToken) -> HRESULT;
        let mut impls = [0u32; 64];
        // SAFETY: EnumInterfaceImpls has the shape `enumerate` calls.
        let count = unsafe { self.enumerate(slot::ENUM_INTERFACE_IMPLS, type_def, &mut impls) }?;
        let mut names = Vec::new();
        for &implementation in &impls[..count] {
            let (mut class, mut interface) = (0u32, 0u32);
            // SAFETY: GetInterfaceImplProps.
            unsafe {
                let props: ImplProps = self.method(slot::GET_INTERFACE_IMPL_PROPS);
                check(props(self.this.as_ptr(), implementation, &mut class, &mut interface))?;
            }
            match interface & MDT_MASK {
                MDT_TYPE_DEF => names.push(self.get_type_def_props(interface)?.name),
                MDT_TYPE_REF => names.push(self.get_type_ref_name(interface)?),
                _ => {}
            }
        }
        Ok(names)
    }

    /// A type reference's namespace-qualified name.
    pub fn get_type_ref_name(&self, type_ref: MdToken) -> HResult<String> {
        type F = unsafe extern "C" fn(*mut c_void, MdToken, *mut MdToken, *mut u16, u32, *mut u32) -> HRESULT;
        let mut buf = [0u16; NAME_CAPACITY];
        let (mut scope, mut len) = (0u32, 0u32);
        // SAFETY: GetTypeRefProps.
        unsafe {
            let f: F = self.method(slot::GET_TYPE_REF_PROPS);
            check(f(self.this.as_ptr(), type_ref, &mut scope, buf.as_mut_ptr(), buf.len() as u32, &mut len))?;
        }
        Ok(utf16_until_nul(&buf[..(len as usize).min(buf.len())]))
    }

    /// Calls an `Enum…(HCORENUM*, owner, tokens[], max, count*)` method
    /// once, into `tokens`, and closes its enumerator: how many tokens it
    /// gave (none with `S_FALSE`).
    ///
    /// # Safety
    /// `slot` must be such a method of this interface.
    unsafe fn enumerate(&self, slot: usize, owner: MdToken, tokens: &mut [MdToken]) -> HResult<usize> {
        type Enum =
            unsafe extern "C" fn(*mut c_void, *mut *mut c_void, MdToken, *mut MdToken, u32, *mut u32) -> HRESULT;
        type Close = unsafe extern "C" fn(*mut c_void, *mut c_void);
        let mut count = 0u32;
        let mut henum: *mut c_void = std::ptr::null_mut();
        // SAFETY: per the caller, then CloseEnum on the same HCORENUM.
        let hr = unsafe {
            let enumerate: Enum = self.method(slot);
            let hr =
                enumerate(self.this.as_ptr(), &mut henum, owner, tokens.as_mut_ptr(), tokens.len() as u32, &mut count);
            if !henum.is_null() {
                let close: Close = self.method(slot::CLOSE_ENUM);
                close(self.this.as_ptr(), henum);
            }
            hr
        };
        check(hr).map(|_| (count as usize).min(tokens.len()))
    }

    /// The type a nested type is declared in.
    pub fn get_enclosing_class(&self, nested: MdToken) -> HResult<MdToken> {
        type F = unsafe extern "C" fn(*mut c_void, MdToken, *mut MdToken) -> HRESULT;
        let mut enclosing = 0;
        // SAFETY: GetNestedClassProps.
        unsafe {
            let f: F = self.method(slot::GET_NESTED_CLASS_PROPS);
            check(f(self.this.as_ptr(), nested, &mut enclosing))?;
        }
        Ok(enclosing)
    }

    /// Names of the generic parameters a type or method declares, in order.
    /// Empty when the module's importer predates generics.
    pub fn generic_param_names(&self, owner: MdToken) -> HResult<Vec<String>> {
        if !self.has_generics {
            return Ok(Vec::new());
        }
        type Props = unsafe extern "C" fn(
            *mut c_void,
            MdToken,
            *mut u32,
            *mut u32,
            *mut MdToken,
            *mut u32,
            *mut u16,
            u32,
            *mut u32,
        ) -> HRESULT;
        let mut params = [0u32; 64];
        // SAFETY: EnumGenericParams has the shape `enumerate` calls.
        let count = unsafe { self.enumerate(slot::ENUM_GENERIC_PARAMS, owner, &mut params) }?;
        let mut names = Vec::with_capacity(count);
        for &param in &params[..count] {
            let mut buf = [0u16; 256];
            let (mut seq, mut flags, mut owner_out, mut reserved, mut len) = (0u32, 0u32, 0u32, 0u32, 0u32);
            // SAFETY: GetGenericParamProps.
            unsafe {
                let props: Props = self.method(slot::GET_GENERIC_PARAM_PROPS);
                check(props(
                    self.this.as_ptr(),
                    param,
                    &mut seq,
                    &mut flags,
                    &mut owner_out,
                    &mut reserved,
                    buf.as_mut_ptr(),
                    buf.len() as u32,
                    &mut len,
                ))?;
            }
            names.push(utf16_until_nul(&buf[..(len as usize).min(buf.len())]));
        }
        Ok(names)
    }
}

/// A module's metadata open for writing (`IMetaDataEmit`). Releases its
/// reference when dropped.
#[derive(Debug)]
pub struct MetaDataEmit {
    this: NonNull<c_void>,
}

// SAFETY: as for `MetaDataImport`; used from one thread at a time.
unsafe impl Send for MetaDataEmit {}

impl Drop for MetaDataEmit {
    fn drop(&mut self) {
        // SAFETY: we own one reference.
        unsafe { crate::info::release(self.this) }
    }
}

impl MetaDataEmit {
    /// # Safety
    /// `this` must be an owned reference to `IMetaDataEmit`.
    pub(crate) unsafe fn from_raw(this: NonNull<c_void>) -> Self {
        MetaDataEmit { this }
    }

    /// The `StandAloneSig` token of `signature` (made if the module has none).
    pub fn get_token_from_sig(&self, signature: &[u8]) -> HResult<MdToken> {
        type F = unsafe extern "C" fn(*mut c_void, *const u8, u32, *mut MdToken) -> HRESULT;
        let mut token = 0;
        // SAFETY: GetTokenFromSig(PCCOR_SIGNATURE, ULONG, mdSignature*); the
        // slot is inside IMetaDataEmit's vtable (asserted order above).
        unsafe {
            let vtbl = *(self.this.as_ptr() as *const *const *const c_void);
            let f = std::mem::transmute_copy::<*const c_void, F>(&*vtbl.add(emit_slot::GET_TOKEN_FROM_SIG));
            check(f(self.this.as_ptr(), signature.as_ptr(), signature.len() as u32, &mut token))?;
        }
        Ok(token)
    }
}
