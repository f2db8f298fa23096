//! Turns a `FunctionID` into `Namespace.Type<T>+Nested.Method<U>`, once per
//! id, on the sampler thread after the runtime has been resumed.
//!
//! The resolver is owned by the sampler thread alone, so its caches need no
//! lock; and it is never used while the runtime is suspended, so the runtime
//! calls it makes (metadata reads) cannot wait on a suspended thread.

use std::collections::HashMap;

use std::sync::Arc;

use corsnap_wire::StateMachine;

use corsnap_abi::{hr, CorProfilerInfo, FunctionID, HResult, HResultError, MdToken, MetaDataImport, ModuleID};

use crate::modules::ModuleState;
use crate::naming::{push_generic_params, strip_arity};
use crate::Shared;

/// A resolved function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionName {
    pub name: String,
    /// The module's file name (`app.dll`).
    pub module: String,
    /// Where its source lines are found: the module, the path it was loaded
    /// from (empty if from memory), and the method's `MethodDef` token.
    pub module_id: ModuleID,
    pub module_path: String,
    pub method_token: MdToken,
    /// For a compiler-generated state machine's `MoveNext`, what its type
    /// declares it implements.
    pub state_machine: Option<StateMachine>,
}

/// A type's display name and how many generic parameters it (with its
/// enclosing types) declares, so a nested type shows only its own.
#[derive(Debug, Clone)]
struct TypeName {
    display: String,
    generic_count: usize,
}

#[derive(Debug)]
pub struct NameResolver {
    shared: Arc<Shared>,
    info: CorProfilerInfo,
    modules: HashMap<ModuleID, String>,
    types: HashMap<(ModuleID, MdToken), TypeName>,
    classes: HashMap<corsnap_abi::ClassID, String>,
    resets: u64,
}

impl NameResolver {
    pub fn new(shared: Arc<Shared>) -> Self {
        NameResolver {
            info: shared.info,
            shared,
            modules: HashMap::new(),
            types: HashMap::new(),
            classes: HashMap::new(),
            resets: 0,
        }
    }

    /// Times a cache was emptied for hitting its cap.
    pub fn cache_resets(&self) -> u64 {
        self.resets
    }

    /// Empties every cache that has reached its cap.
    fn bound_caches(&mut self) {
        let cap = crate::sampler::CACHE_CAP;
        if self.types.len() >= cap || self.classes.len() >= cap || self.modules.len() >= cap {
            self.types.clear();
            self.classes.clear();
            self.modules.clear();
            self.resets += 1;
        }
    }

    pub fn resolve(&mut self, function: FunctionID) -> HResult<FunctionName> {
        self.bound_caches();
        if crate::faults::get().names && crate::faults::get().every(2) {
            return Err(HResultError(hr::E_FAIL));
        }
        let (_class, module, method_token) = self.info.get_function_info2(function)?;
        if self.shared.modules.state(module) == Some(ModuleState::Unloading) {
            // The module is going away: its metadata must not be touched.
            return Err(HResultError(hr::CORPROF_E_DATAINCOMPLETE));
        }
        let module_path = self.module_path(module);
        let module_name = module_path.rsplit('/').next().unwrap_or(&module_path).to_string();
        let metadata = self.info.get_module_metadata(module)?;
        let method = metadata.get_method_props(method_token)?;
        let method_generics = metadata.generic_param_names(method_token).unwrap_or_default();
        let type_name = self.type_name(&metadata, module, method.class_token, 0)?;
        let mut name = String::with_capacity(type_name.display.len() + method.name.len() + 8);
        if !type_name.display.is_empty() {
            name.push_str(&type_name.display);
            name.push('.');
        }
        name.push_str(&method.name);
        push_generic_params(&mut name, &method_generics);
        let state_machine = if method.name == "MoveNext" && type_name.display.contains("+<") {
            // Roslyn names an async method's, an iterator's and an async
            // iterator's state machine alike; the interfaces tell them
            // apart where the stack may not (an inlined `Start`).
            metadata
                .interface_names(method.class_token)
                .ok()
                .and_then(|names| StateMachine::from_interfaces(names.iter().map(String::as_str)))
        } else {
            None
        };
        Ok(FunctionName { name, module: module_name, module_id: module, module_path, method_token, state_machine })
    }

    /// A class's display name (an exception's or a loaded class's type),
    /// cached per `ClassID`; never an error, since it labels a sample.
    pub fn class_name(&mut self, class: corsnap_abi::ClassID) -> String {
        self.bound_caches();
        if let Some(n) = self.classes.get(&class) {
            return n.clone();
        }
        let name = self.lookup_class(class).unwrap_or_else(|e| format!("[class 0x{class:x}: {e}]"));
        self.classes.insert(class, name.clone());
        name
    }

    fn lookup_class(&mut self, class: corsnap_abi::ClassID) -> HResult<String> {
        let (module, token) = self.info.get_class_id_info(class)?;
        if token & 0x00FF_FFFF == 0 {
            // Arrays and other constructed types have no typedef of their own.
            return Ok("[array or constructed type]".to_string());
        }
        if self.shared.modules.state(module) == Some(ModuleState::Unloading) {
            return Err(HResultError(hr::CORPROF_E_DATAINCOMPLETE));
        }
        let metadata = self.info.get_module_metadata(module)?;
        Ok(self.type_name(&metadata, module, token, 0)?.display)
    }

    fn module_path(&mut self, module: ModuleID) -> String {
        if let Some(n) = self.modules.get(&module) {
            return n.clone();
        }
        let path = self.info.get_module_path(module).unwrap_or_default();
        self.modules.insert(module, path.clone());
        path
    }

    fn type_name(
        &mut self,
        metadata: &MetaDataImport,
        module: ModuleID,
        token: MdToken,
        depth: usize,
    ) -> HResult<TypeName> {
        // Methods outside any type (module-level functions) have token 0x02000001 `<Module>`
        // or a nil token; show just the method then.
        if token & 0x00FF_FFFF == 0 {
            return Ok(TypeName { display: String::new(), generic_count: 0 });
        }
        if let Some(t) = self.types.get(&(module, token)) {
            return Ok(t.clone());
        }
        let props = metadata.get_type_def_props(token)?;
        let params = metadata.generic_param_names(token).unwrap_or_default();
        let bare = strip_arity(&props.name);
        let (mut display, inherited) = if props.is_nested() && depth < 64 {
            let enclosing_token = metadata.get_enclosing_class(token)?;
            let enclosing = self.type_name(metadata, module, enclosing_token, depth + 1)?;
            (format!("{}+{}", enclosing.display, bare), enclosing.generic_count)
        } else {
            (bare.to_string(), 0)
        };
        // A nested type repeats its enclosing types' parameters first; C# shows only its own.
        push_generic_params(&mut display, params.get(inherited..).unwrap_or(&[]));
        let name = TypeName { display, generic_count: params.len().max(inherited) };
        self.types.insert((module, token), name.clone());
        Ok(name)
    }
}
